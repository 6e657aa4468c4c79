package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// fenceStream makes stream capture its fence subjects, take atomic batches and roll its fence
// records up, as setup makes a replicated output stream.
func (f *fixture) fenceStream(name string) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, name)
	if err != nil {
		f.t.Fatal(err)
	}
	c := s.CachedInfo().Config
	c.Subjects = append(c.Subjects, subjects.FenceFilter(name))
	c.AllowAtomicPublish, c.AllowRollup = true, true
	if _, err := f.js.UpdateStream(ctx, c); err != nil {
		f.t.Fatal(err)
	}
}

// fenceRecords returns how many fence records stream holds, by fence subject.
func (f *fixture) fenceRecords(stream string) map[string]uint64 {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, stream)
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subjects.FenceFilter(stream)))
	if err != nil {
		f.t.Fatal(err)
	}
	return info.State.Subjects
}

// fenceOnce runs partition p's lane under epoch until it has fenced every stream of fenced,
// then stops it.
func fenceOnce(t *testing.T, pool *lanes.Pool, p int, epoch uint64, fenced int) {
	t.Helper()
	stop, res := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: epoch, Owner: fmt.Sprintf("r%d", epoch)})
	natstest.Eventually(t, 10*time.Second, func() error {
		select {
		case err := <-res:
			t.Fatalf("the lane of epoch %d stopped before it fenced its outputs: %v", epoch, err)
		default:
		}
		if n := len(pool.Fences(p)); n != fenced {
			return fmt.Errorf("epoch %d: %d of %d outputs fenced", epoch, n, fenced)
		}
		return nil
	})
	stop()
}

// TestFenceRecordsStayOnePerPartition: every takeover writes a fence record, and the check needs
// only the last: after many takeovers each output stream holds one record per partition, not one
// per takeover (which grew without bound, and in PARKED ran into its per-subject limit).
func TestFenceRecordsStayOnePerPartition(t *testing.T) {
	f := newFixture(t)
	fenced := []string{f.names.Outgoing, f.names.Unmapped}
	for _, s := range fenced {
		f.fenceStream(s)
	}
	pool := f.newPool(lanes.Config{Fences: fenced})
	const takeovers = 12
	parts := []int{0, 5}
	for i := range takeovers {
		for _, p := range parts {
			fenceOnce(t, pool, p, uint64(100+i), len(fenced))
		}
	}
	for _, stream := range fenced {
		recs := f.fenceRecords(stream)
		if len(recs) != len(parts) {
			t.Errorf("%s holds fence records on %d subjects (%v), want %d: one per partition taken over", stream, len(recs), recs, len(parts))
		}
		for subj, n := range recs {
			if n != 1 {
				t.Errorf("%s holds %d fence records on %s after %d takeovers, want 1", stream, n, subj, takeovers)
			}
		}
	}
	// The last owner's record is the one kept, and it fences: its lane maps.
	for _, stream := range fenced {
		for _, p := range parts {
			if r, _ := f.record(stream, p); r.Epoch != 100+takeovers-1 {
				t.Errorf("%s: partition %d's record is of epoch %d, want the last takeover's %d", stream, p, r.Epoch, 100+takeovers-1)
			}
		}
	}
}

// fillParked stores n messages of devices no lane runs for in PARKED, whose limit is n in all.
func (f *fixture) fillParked(n int) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range n {
		dev := fmt.Sprintf("filler-%d", i)
		if _, err := f.js.Publish(ctx, subjects.ParkedSubject("parked", subjects.Partition(dev, f.lay.Partitions), dev), []byte("x")); err != nil {
			f.t.Fatalf("filling PARKED: %v", err)
		}
	}
	if _, err := f.js.Publish(ctx, subjects.ParkedSubject("parked", 0, "one-too-many"), []byte("x")); err == nil || !strings.Contains(err.Error(), "maximum messages") {
		f.t.Fatalf("publishing past PARKED's limit: %v, want maximum messages exceeded: the test proves nothing", err)
	}
}

// A full PARKED (discard new, its MaxMsgs reached by parked messages) must not keep a partition
// from ever mapping again: a partition that has a fence record there gets its new owner's record
// all the same, in place of the old one; one that has none cannot be fenced there, and its lane
// gives the partition up at once (Run returns an error wrapping ErrFenceWrite, which its owner
// counts and releases the lease on), rather than retrying for ever while holding the lease.
func TestFullParkedStillFencesOrGivesUp(t *testing.T) {
	f := newFixture(t)
	const limit = 20
	cfg := f.parkOn(lanes.Config{}, 5, limit)
	fenced := []string{f.names.Outgoing, f.names.Unmapped, "PARKED"}
	for _, s := range fenced {
		f.fenceStream(s)
	}
	cfg.Fences = fenced
	pool := f.newPool(cfg)
	fenceOnce(t, pool, 3, 10, len(fenced)) // partition 3 has its records; partition 4 none
	f.fillParked(limit - 1)                // the records of partition 3 take one place

	fenceOnce(t, pool, 3, 11, len(fenced))
	if r, _ := f.record("PARKED", 3); r.Epoch != 11 {
		t.Errorf("PARKED: partition 3's record is of epoch %d after a takeover while PARKED was full, want 11", r.Epoch)
	}
	if n := f.fenceRecords("PARKED")[subjects.FenceSubject("PARKED", 3)]; n != 1 {
		t.Errorf("PARKED holds %d records of partition 3, want 1", n)
	}

	_, res := runLane(t, pool, lanes.Assignment{Partition: 4, Epoch: 12, Owner: "r12"})
	select {
	case err := <-res:
		if !errors.Is(err, lanes.ErrFenceWrite) {
			t.Fatalf("Run of a partition PARKED has no room to fence = %v, want ErrFenceWrite", err)
		}
		if !strings.Contains(err.Error(), "PARKED") {
			t.Errorf("Run() = %v, want the error to name the stream", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the lane of a partition PARKED has no room to fence still holds it 10s later")
	}
}
