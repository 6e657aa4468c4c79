package status_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// TestReadDirectMode reads a deployment that setup made in direct mode (no INCOMING; the control
// bucket marked so) with the control bucket written as its replicas write it: Read must not look
// for INCOMING, and must show the owners, their reported lags, OUTGOING and UNMAPPED.
func TestReadDirectMode(t *testing.T) {
	ctx := context.Background()
	srv := natstest.Start(t)
	nc, js := srv.JetStream(t)
	names := subjects.Names{}.WithDefaults()
	// Receive all: the server needs no account mapping.
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t), Mode: wire.ModeDirect, Receive: wire.ReceiveAll}); err != nil {
		t.Fatalf("setup.Ensure(direct): %v", err)
	}
	ctl, err := js.KeyValue(ctx, names.Control)
	if err != nil {
		t.Fatal(err)
	}
	// Partitions 0-7 to r0, 8-15 to r1; only r0 answers, reporting what waits in its queues.
	for p := range partitions {
		owner := "r0"
		if p >= 8 {
			owner = "r1"
		}
		if _, err := ctl.Create(ctx, wire.LeaseKey(p), []byte(owner), jetstream.KeyTTL(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"r0", "r1"} {
		if _, err := ctl.PutString(ctx, wire.MemberKey(id), id); err != nil {
			t.Fatal(err)
		}
	}
	newService(t, srv.Connect(t), "r0", func() status.Report {
		r := status.Report{Ready: true, Owned: []int{0, 1, 2, 3, 4, 5, 6, 7}}
		for p := range 8 {
			r.Partitions = append(r.Partitions, status.PartitionReport{Partition: p, Epoch: uint64(100 + p), Pending: uint64(p), Lag: uint64(p)})
		}
		return r
	})
	natstest.Eventually(t, 5*time.Second, func() error {
		_, err := nc.Request(status.StatusSubject(names.Control, "r0"), nil, time.Second)
		return err
	})
	// What a device's publish leaves in the outputs.
	for _, subj := range []string{"outgoing.g.dev-1.t", "outgoing.g.dev-2.t", "unmapped.dev-3.t"} {
		if _, err := js.Publish(ctx, subj, []byte("x")); err != nil {
			t.Fatal(err)
		}
	}

	snap, err := status.Read(ctx, js, status.ReadConfig{Layout: layout(t), Timeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatalf("Read() in direct mode = %v, want a snapshot without INCOMING", err)
	}
	if snap.Mode != "direct" {
		t.Errorf("Read().Mode = %q, want direct", snap.Mode)
	}
	for _, p := range snap.Partitions {
		wantOwner, wantFrom, wantLag := "r0", "replica", uint64(p.Partition)
		if p.Partition >= 8 {
			wantOwner, wantFrom, wantLag = "r1", "", 0
		}
		if p.Owner != wantOwner || p.LagFrom != wantFrom || p.Lag != wantLag || p.LeaseRevision == 0 {
			t.Errorf("partition %d: owner %q, lag %d from %q, lease revision %d; want %q, %d from %q, a revision",
				p.Partition, p.Owner, p.Lag, p.LagFrom, p.LeaseRevision, wantOwner, wantLag, wantFrom)
		}
	}
	if len(snap.Replicas) != 2 || snap.Replicas[0].Report == nil || len(snap.Replicas[0].Leases) != 8 || len(snap.Replicas[1].Leases) != 8 {
		t.Errorf("Read().Replicas = %+v, want r0 (reporting) and r1 with 8 leases each", snap.Replicas)
	}
	want := []struct {
		name string
		msgs uint64
	}{{"OUTGOING", 2}, {"UNMAPPED", 1}}
	if len(snap.Outputs) != len(want) {
		t.Fatalf("Read().Outputs = %+v, want OUTGOING and UNMAPPED", snap.Outputs)
	}
	for i, w := range want {
		if o := snap.Outputs[i]; o.Name != w.name || o.Messages != w.msgs || o.LastSeq != w.msgs {
			t.Errorf("Read().Outputs[%d] = %+v, want %s with %d messages", i, o, w.name, w.msgs)
		}
	}
	for _, r := range snap.Replication {
		if r.Stream == "INCOMING" || r.Error != "" {
			t.Errorf("Read().Replication has %+v, want no INCOMING and no error", r)
		}
	}
	if len(snap.Replication) != 4 {
		t.Errorf("Read().Replication lists %d streams, want OUTGOING, UNMAPPED and the two buckets", len(snap.Replication))
	}

	var buf bytes.Buffer
	if err := snap.WriteText(&buf); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, s := range []string{
		"direct mode: no INCOMING to read",
		"control bucket kvmapper: 16 of 16 partitions leased, 2 members",
		"stream OUTGOING: 2 messages, sequences 1 to 2",
		"stream UNMAPPED: 1 message, sequences 1 to 1",
	} {
		if !strings.Contains(out, s) {
			t.Errorf("WriteText output lacks %q:\n%s", s, out)
		}
	}
	if strings.Contains(out, "stream INCOMING") {
		t.Errorf("WriteText output in direct mode names INCOMING:\n%s", out)
	}
	b, err := json.Marshal(snap)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if _, ok := doc["incoming"]; ok || doc["mode"] != "direct" {
		t.Errorf("JSON has mode %v and incoming %v, want direct and no incoming", doc["mode"], doc["incoming"])
	}
}

// TestReadDirectModeByConfig reads a direct-mode deployment whose control bucket is not marked (a
// deployment set up before the mark existed) with ReadConfig.Direct; without it, Read's error
// says how to tell it.
func TestReadDirectModeByConfig(t *testing.T) {
	ctx := context.Background()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t), Mode: wire.ModeDirect, Receive: wire.ReceiveAll}); err != nil {
		t.Fatalf("setup.Ensure(direct): %v", err)
	}
	ctl, err := js.KeyValue(ctx, "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	if err := ctl.Purge(ctx, wire.ModeKey); err != nil {
		t.Fatal(err)
	}
	_, err = status.Read(ctx, js, status.ReadConfig{Layout: layout(t), NoStreamLag: true})
	if err == nil || !strings.Contains(err.Error(), "stream not found") || !strings.Contains(err.Error(), "--mode direct") {
		t.Errorf("Read() of an unmarked direct deployment = %v, want stream not found, naming --mode direct", err)
	}
	snap, err := status.Read(ctx, js, status.ReadConfig{Layout: layout(t), Direct: true})
	if err != nil || snap.Mode != "direct" || len(snap.Outputs) != 2 {
		t.Fatalf("Read(Direct) = %+v, %v; want a direct-mode snapshot", snap, err)
	}
	for p := range snap.Partitions {
		if o := snap.Partitions[p].Owner; o != "" {
			t.Errorf("partition %d owned by %q, want none", p, o)
		}
	}
}
