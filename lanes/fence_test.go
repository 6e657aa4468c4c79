package lanes_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// A new owner fences the partition by writing its checkpoint back. The old lane, whose lease
// clock still says valid, must stop sending at its next checkpoint write, not when it is
// stopped: OUTGOING drops what it sends meanwhile as duplicates, so only the wire can tell.
// Every publish carries its owner's epoch; the old owner's are counted as they go out.
func TestFencedByCheckpointWrite(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		dev := "dev-fence"
		p := subjects.Partition(dev, 16)
		f.groups.set(dev, "g")
		var mu sync.Mutex
		var old []string // Nats-Msg-Id of every publish of epoch 1
		seen := make(chan string, 1000)
		watcher := f.srv.Connect(t)
		if _, err := watcher.Subscribe("outgoing.>", func(m *nats.Msg) {
			if epochOf(m.Header) == "1" {
				mu.Lock()
				old = append(old, m.Header.Get(nats.MsgIdHdr))
				mu.Unlock()
			}
			select {
			case seen <- epochOf(m.Header) + " " + m.Header.Get(nats.MsgIdHdr):
			default: // the test stopped reading: never block the connection's dispatcher
			}
		}); err != nil {
			t.Fatal(err)
		}
		if err := watcher.Flush(); err != nil {
			t.Fatal(err)
		}
		cfg := f.config(lanes.Config{CheckpointInterval: 20 * time.Millisecond})
		first, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
		if err != nil {
			t.Fatal(err)
		}
		_, res := runLane(t, first, lanes.Assignment{Partition: p, Epoch: 1})
		natstest.Eventually(t, 5*time.Second, func() error {
			if len(first.Partitions()) != 1 {
				return errors.New("the old owner has not fenced yet")
			}
			return nil
		})
		f.publish([]string{dev}, 1, nil)
		natstest.Eventually(t, 5*time.Second, func() error {
			if f.checkpoint(p) != 1 {
				return errors.New("checkpoint not written yet")
			}
			return nil
		})
		// The new owner fences the partition, and maps from the checkpoint on.
		next, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
		if err != nil {
			t.Fatal(err)
		}
		runLane(t, next, lanes.Assignment{Partition: p, Epoch: 2})
		natstest.Eventually(t, 5*time.Second, func() error {
			if len(next.Partitions()) != 1 {
				return errors.New("the new owner has not fenced yet")
			}
			return nil
		})
		// Both map this one; the old owner's checkpoint write after it must fail, and stop it.
		f.publishFrom([]string{dev}, 1, 1, nil)
		select {
		case err := <-res:
			if !errors.Is(err, lanes.ErrFenced) {
				t.Errorf("Run(old owner) = %v, want ErrFenced", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("the old owner still runs 10s after its checkpoint write conflicted (interval 20ms)")
		}
		// From now on only the new owner sends: wait until the wire carries its copy of the last
		// message, then look for the old owner's.
		f.publishFrom([]string{dev}, 2, 20, nil)
		for last := "2 " + f.msgID(dev, 22); ; {
			select {
			case s := <-seen:
				if s != last {
					continue
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("the new owner did not publish %s within 10s", f.msgID(dev, 22))
			}
			break
		}
		mu.Lock()
		defer mu.Unlock()
		for _, id := range old {
			if id != f.msgID(dev, 1) && id != f.msgID(dev, 2) {
				t.Errorf("the old owner published %s after its checkpoint write was fenced (it published %q)", id, old)
				break
			}
		}
	})
}

func TestLeaseClockStopsPublishing(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		dev := "dev-lost"
		p := subjects.Partition(dev, 16)
		f.groups.set(dev, "g")
		other := "dev-other"
		for subjects.Partition(other, 16) == p {
			other += "x"
		}
		f.groups.set(other, "g")
		var lost atomic.Bool
		pool, err := lanes.New(f.js, f.ctl, f.groups.lookup, f.config(lanes.Config{}))
		if err != nil {
			t.Fatal(err)
		}
		res := make(chan error, 1)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			res <- pool.Run(ctx, lanes.Assignment{Partition: p, Epoch: 1, Valid: func() bool { return !lost.Load() }})
		}()
		f.publish([]string{dev}, 1, nil)
		f.read("OUTGOING", 1)
		lost.Store(true)
		// The scenario, not a synchronisation: a lane may answer a check from a reading of its
		// lease clock up to 1 ms old (leaseclock.go), so the lease has run out longer than that
		// when the next message can come. A message sooner could be published, as documented.
		time.Sleep(5 * time.Millisecond)
		f.publish([]string{dev}, 1, nil)
		select {
		case err := <-res:
			if !errors.Is(err, lanes.ErrFenced) {
				t.Fatalf("Run = %v, want ErrFenced", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("lane kept running after its lease clock ran out")
		}
		if n := pool.Stats().Mapped; n != 1 {
			t.Errorf("mapped %d, want 1: nothing may be published once the lease is invalid", n)
		}
		s, _ := f.js.Stream(context.Background(), "OUTGOING")
		info, _ := s.Info(context.Background())
		if info.State.Msgs != 1 {
			t.Errorf("OUTGOING holds %d, want 1", info.State.Msgs)
		}
	})
}

// The lane reads its lease clock (a system call on Linux) once per burst of checks, not once or
// twice per message: at most once per millisecond and per 64 publishes (leaseclock.go). Counted
// here over a backlog of one partition, against that bound from the time the whole run took.
func TestLeaseClockIsReadPerBurst(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-clock"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	const n = 3000
	f.publish([]string{dev}, n, nil)
	var reads atomic.Int64
	pool := f.newPool(lanes.Config{})
	start := time.Now()
	stop, _ := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1, Valid: func() bool { reads.Add(1); return true }})
	f.waitOrDump(pool, "OUTGOING", n, 60*time.Second)
	got, el := reads.Load(), time.Since(start)
	stop()
	bound := n/64 + el.Milliseconds() + 4
	t.Logf("%d messages in %v: %d readings of the lease clock (bound %d)", n, el, got, bound)
	if got > bound {
		t.Fatalf("the lane read its lease clock %d times for %d messages in %v, want at most %d (once per ms and per 64 publishes)", got, n, el, bound)
	}
}
