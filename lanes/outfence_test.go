package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// fenceStreams makes OUTGOING and UNMAPPED capture their fence subjects, as setup does on a
// cluster, and returns their names.
func (f *fixture) fenceStreams() []string {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	names := []string{f.names.Outgoing, f.names.Unmapped}
	for _, name := range names {
		s, err := f.js.Stream(ctx, name)
		if err != nil {
			f.t.Fatal(err)
		}
		c := s.CachedInfo().Config
		c.Subjects = append(c.Subjects, subjects.FenceFilter(name))
		c.AllowAtomicPublish = true
		if _, err := f.js.UpdateStream(ctx, c); err != nil {
			f.t.Fatal(err)
		}
	}
	return names
}

// fenceSubject is partition p's fence subject in stream as it is now (its incarnation).
func (f *fixture) fenceSubject(stream string, p int) string {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, stream)
	if err != nil {
		f.t.Fatal(err)
	}
	return subjects.FenceSubject(stream, p, wire.Incarnation(s.CachedInfo().Created))
}

// record reads partition p's last fence record in stream, with its sequence.
func (f *fixture) record(stream string, p int) (wire.FenceRecord, uint64) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m, err := kvcas.LastOfSubject(ctx, f.js, stream, f.fenceSubject(stream, p))
	if errors.Is(err, kvcas.ErrNotFound) {
		return wire.FenceRecord{}, 0
	}
	if err != nil {
		f.t.Fatal(err)
	}
	r, err := wire.ParseFenceRecord(m.Data)
	if err != nil {
		f.t.Fatal(err)
	}
	return r, m.Sequence
}

// TestTakeoverWritesTheFenceRecords: a lane that takes a partition over writes its fence record
// in each fenced output stream before it publishes anything, and hands the records' sequences
// to its writer (Pool.Fences); a later owner's record is written over it. A lane whose epoch is
// older than the record it finds has been taken over since it claimed: it stops with ErrFenced
// and publishes nothing.
func TestTakeoverWritesTheFenceRecords(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	fenced := f.fenceStreams()
	dev := "dev-f"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	cfg := f.config(lanes.Config{CheckpointInterval: 20 * time.Millisecond, Fences: fenced})
	owner := func(epoch uint64) (*lanes.Pool, func(), <-chan error) {
		pool, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop, res := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: epoch, Owner: fmt.Sprintf("r%d", epoch)})
		return pool, stop, res
	}
	seqs := func(pool *lanes.Pool) []uint64 {
		var out []uint64
		for _, fe := range pool.Fences(p) {
			out = append(out, fe.Seq)
		}
		return out
	}

	first, stopFirst, _ := owner(10)
	natstest.Eventually(t, 5*time.Second, func() error {
		if len(first.Fences(p)) != len(fenced) {
			return errors.New("the lane has not fenced its outputs yet")
		}
		return nil
	})
	var want []uint64
	for i, stream := range fenced {
		r, seq := f.record(stream, p)
		if r.Epoch != 10 || r.Owner != "r10" || r.Partition != p || r.Control == "" || seq == 0 {
			t.Errorf("%s: record %+v at %d, want epoch 10 of r10 for partition %d", stream, r, seq, p)
		}
		if fe := first.Fences(p)[i]; fe.Stream != stream || fe.Subject != f.fenceSubject(stream, p) {
			t.Errorf("Fences(%d)[%d] = %+v, want stream %s, subject %s", p, i, fe, stream, f.fenceSubject(stream, p))
		}
		want = append(want, seq)
	}
	if got := seqs(first); !slices.Equal(got, want) {
		t.Errorf("Fences(%d) sequences %v, want the records' %v", p, got, want)
	}
	f.publish([]string{dev}, 3, nil)
	f.read(f.names.Outgoing, 3+1) // its record, then its messages
	stopFirst()

	later, _, _ := owner(20)
	natstest.Eventually(t, 5*time.Second, func() error {
		if len(later.Fences(p)) != len(fenced) {
			return errors.New("the later lane has not fenced its outputs yet")
		}
		return nil
	})
	for i, stream := range fenced {
		if r, seq := f.record(stream, p); r.Epoch != 20 || seq <= want[i] {
			t.Errorf("%s: record %+v at %d after the later owner's takeover, want epoch 20 past %d", stream, r, seq, want[i])
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, f.names.Outgoing)
	if err != nil {
		t.Fatal(err)
	}
	before, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, _, res := owner(15) // claimed before 20, and running only now
	select {
	case err := <-res:
		if !errors.Is(err, lanes.ErrFenced) {
			t.Fatalf("Run of an owner older than the record = %v, want ErrFenced", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("an owner older than the record is still running 10s later")
	}
	after, err := s.Info(ctx, jetstream.WithSubjectFilter(">"))
	if err != nil {
		t.Fatal(err)
	}
	if after.State.LastSeq != before.State.LastSeq {
		t.Errorf("OUTGOING went from sequence %d to %d while the older owner ran, want nothing written", before.State.LastSeq, after.State.LastSeq)
	}
}

// TestFenceRecordAfterTheControlBucketIsRecreated: the control bucket deleted and made again under
// a running pool starts its lease revisions, the owners' epochs, from 1 again. A lane of the same
// pool that claims a partition in the new bucket, at an epoch far below its predecessor's, must
// write its fence record under the new bucket's incarnation, which supersedes every record of the
// old one: under the incarnation the pool read first, the old owner's larger epoch fenced it at
// once, at every claim, until the new bucket's revisions passed the old ones.
func TestFenceRecordAfterTheControlBucketIsRecreated(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	fenced := f.fenceStreams()
	dev := "dev-f"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	pool, err := lanes.New(f.js, f.ctl, f.groups.lookup, f.config(lanes.Config{CheckpointInterval: 20 * time.Millisecond, Fences: fenced}))
	if err != nil {
		t.Fatal(err)
	}
	fencedBy := func(epoch uint64) {
		t.Helper()
		natstest.Eventually(t, 10*time.Second, func() error {
			for _, stream := range fenced {
				if r, _ := f.record(stream, p); r.Epoch != epoch {
					return fmt.Errorf("%s: record of epoch %d, want %d", stream, r.Epoch, epoch)
				}
			}
			return nil
		})
	}
	stop, _ := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1000, Owner: "r1"})
	fencedBy(1000)
	old, _ := f.record(f.names.Outgoing, p)
	f.publish([]string{dev}, 3, nil)
	f.read(f.names.Outgoing, 3+1)
	stop()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.js.DeleteKeyValue(ctx, "kvmapper"); err != nil {
		t.Fatal(err)
	}
	if _, err := setup.Ensure(ctx, f.js, f.setupConfig()); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	_, res := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 5, Owner: "r1"})
	natstest.Eventually(t, 10*time.Second, func() error {
		select {
		case err := <-res:
			t.Fatalf("the lane of the new bucket's epoch 5 stopped: %v", err)
		default:
		}
		for _, stream := range fenced {
			if r, _ := f.record(stream, p); r.Epoch != 5 || r.Control == old.Control {
				return fmt.Errorf("%s: record %+v, want epoch 5 under a control incarnation other than %s", stream, r, old.Control)
			}
		}
		return nil
	})
	f.publish([]string{dev}, 3, nil)
	f.read(f.names.Outgoing, 3+1+1+3) // the old record and messages, the new record, the new messages
}
