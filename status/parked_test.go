package status_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
)

func TestReadCountsParkedDevices(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	rcfg := status.ReadConfig{Layout: layout(t), Names: e.names, NoStreamLag: true}
	snap, err := status.Read(ctx, e.js, rcfg)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Parked != nil {
		t.Errorf("Read() without PARKED: Parked = %+v, want nil", snap.Parked)
	}
	if _, err := setup.Ensure(ctx, e.js, setup.Config{Layout: layout(t), Names: e.names, Park: &setup.ParkedStream{}}); err != nil {
		t.Fatal(err)
	}
	// What a lane stores when it parks a message.
	for device, n := range map[string]int{"dev-a": 3, "dev-b": 1} {
		for range n {
			subj := subjects.ParkedSubject("parked", subjects.Partition(device, partitions), device)
			if _, err := e.js.Publish(ctx, subj, []byte("x")); err != nil {
				t.Fatal(err)
			}
		}
	}
	if snap, err = status.Read(ctx, e.js, rcfg); err != nil {
		t.Fatal(err)
	}
	pa := subjects.Partition("dev-a", partitions)
	want := []status.ParkedDevice{{Device: "dev-a", Partition: pa, Messages: 3}, {Device: "dev-b", Partition: subjects.Partition("dev-b", partitions), Messages: 1}}
	if pk := snap.Parked; pk == nil || pk.Messages != 4 || pk.Devices != 2 || len(pk.Top) != 2 || pk.Top[0] != want[0] || pk.Top[1] != want[1] {
		t.Fatalf("Read().Parked = %+v, want 4 messages of 2 devices, %v", snap.Parked, want)
	}
	if p := snap.Partitions[pa]; p.ParkedMessages < 3 || p.ParkedDevices < 1 {
		t.Errorf("partition %d: %d parked messages of %d devices, want dev-a's 3", pa, p.ParkedMessages, p.ParkedDevices)
	}
	var buf bytes.Buffer
	if err := snap.WriteText(&buf); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"stream PARKED: 4 messages parked, of 2 devices", "dev-a", "PARKED DEVICE"} {
		if !strings.Contains(buf.String(), s) {
			t.Errorf("WriteText output lacks %q:\n%s", s, buf.String())
		}
	}
}

// The fence records PARKED holds beside the parked messages (one per partition taken over, on
// kvmapper.fence.PARKED.>) are no parked messages: status counts only what devices parked.
func TestParkedCountSkipsFenceRecords(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	if _, err := setup.Ensure(ctx, e.js, setup.Config{Layout: layout(t), Names: e.names, Park: &setup.ParkedStream{}}); err != nil {
		t.Fatal(err)
	}
	s, err := e.js.Stream(ctx, "PARKED")
	if err != nil {
		t.Fatal(err)
	}
	c := s.CachedInfo().Config
	c.Subjects = append(c.Subjects, subjects.FenceFilter("PARKED"))
	if _, err := e.js.UpdateStream(ctx, c); err != nil {
		t.Fatal(err)
	}
	for p := range 3 {
		if _, err := e.js.Publish(ctx, subjects.FenceSubject("PARKED", p, "inc"), []byte(`{"partition":0}`)); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if _, err := e.js.Publish(ctx, subjects.ParkedSubject("parked", subjects.Partition("dev-a", partitions), "dev-a"), []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	snap, err := status.Read(ctx, e.js, status.ReadConfig{Layout: layout(t), Names: e.names, NoStreamLag: true})
	if err != nil {
		t.Fatal(err)
	}
	if pk := snap.Parked; pk == nil || pk.Messages != 2 || pk.Devices != 1 {
		t.Errorf("Read().Parked = %+v, want dev-a's 2 messages and no fence record", snap.Parked)
	}
}
