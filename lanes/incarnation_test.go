package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// runAll runs every partition in a pool like an owner that keeps its leases: a lane that ends
// with an error other than its context's is started again, as the election does after a
// backoff. It returns the pool and a func that stops every lane and waits for them, and counts
// in f.recreated the runs of each partition that ended with ErrIncomingRecreated.
func (f *fixture) runAll(cfg lanes.Config) (*lanes.Pool, func()) {
	f.t.Helper()
	pool := f.newPool(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	f.recreated = make([]atomic.Int64, f.lay.Partitions)
	for p := range f.lay.Partitions {
		wg.Go(func() {
			for ctx.Err() == nil {
				err := pool.Run(ctx, lanes.Assignment{Partition: p, Epoch: uint64(100 + p)})
				if errors.Is(err, lanes.ErrIncomingRecreated) {
					f.recreated[p].Add(1)
				}
				if err != nil && !errors.Is(err, lanes.ErrIncomingRecreated) {
					f.t.Errorf("Run(%d) = %v, want nil or ErrIncomingRecreated", p, err)
					return
				}
			}
		})
	}
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); wg.Wait() }) }
	f.t.Cleanup(stop)
	return pool, stop
}

// recreateIncoming deletes INCOMING and creates it again as setup does: its sequences start
// again at 1. In the partition-streams layout it re-creates the streams of the even partitions
// only: the others keep their sequences, and their lanes must go on undisturbed.
func (f *fixture) recreateIncoming() {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i, name := range f.names.IncomingStreams(f.lay.Partitions) {
		if i%2 == 1 {
			continue
		}
		if err := f.js.DeleteStream(ctx, name); err != nil {
			f.t.Fatalf("DeleteStream(%s): %v", name, err)
		}
	}
	if _, err := setup.Ensure(ctx, f.js, f.setupConfig()); err != nil {
		f.t.Fatalf("setup.Ensure: %v", err)
	}
}

// msgID is the Nats-Msg-Id of sequence seq of the stream holding device, as that stream is now.
func (f *fixture) msgID(device string, seq uint64) string {
	f.t.Helper()
	return f.idPrefix(f.stream(device)) + strconv.FormatUint(seq, 10)
}

// idPrefix is the Nats-Msg-Id prefix of stream as it is now.
func (f *fixture) idPrefix(stream string) string {
	f.t.Helper()
	s, err := f.js.Stream(context.Background(), stream)
	if err != nil {
		f.t.Fatal(err)
	}
	return wire.MsgIDPrefix(stream, wire.Incarnation(s.CachedInfo().Created))
}

// checkIDs checks that every message carries a Nats-Msg-Id of the current incarnation of the
// stream that holds its partition (from its provenance header).
func (f *fixture) checkIDs(msgs []nats.Header) {
	f.t.Helper()
	for i, h := range msgs {
		pv, ok := wire.ReadProvenance(h.Get)
		if !ok || !pv.HasPartition {
			f.t.Fatalf("message %d: no partition in its provenance: %v", i, h)
		}
		p := pv.Partition
		stream, _ := f.names.IncomingStream(f.lay, p)
		if id, prefix := h.Get(nats.MsgIdHdr), f.idPrefix(stream); !strings.HasPrefix(id, prefix) {
			f.t.Fatalf("message %d after INCOMING was re-created: Nats-Msg-Id %q, want prefix %q", i, id, prefix)
		}
	}
}

// The user's path: stop kvmapper, delete INCOMING, run setup, start again, publish. The
// checkpoints hold the old stream's sequences; honouring them would skip the new stream's
// first messages, and reusing the old Msg-Ids would have OUTGOING drop them as duplicates.
func TestIncomingRecreatedWhileStopped(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		devs := devices(20)
		for _, d := range devs {
			f.groups.set(d, "g")
		}
		_, stop := f.runAll(lanes.Config{})
		f.publish(devs, 100, nil)
		f.read("OUTGOING", 2000)
		stop()
		if f.checkpoint(0) == 0 {
			t.Fatal("checkpoint.0 = 0 before INCOMING was re-created: the test would prove nothing")
		}

		f.recreateIncoming()
		f.publishFrom(devs, 100, 25, nil)
		f.runAll(lanes.Config{})
		msgs := f.read("OUTGOING", 2500)
		checkOrder(t, msgs, devs, 125, func(d string) string { return "outgoing.g." + d + ".evt" })
		var hdrs []nats.Header
		for _, m := range msgs[2000:] {
			hdrs = append(hdrs, m.Headers())
		}
		f.checkIDs(hdrs)
	})
}

// INCOMING deleted and created again while the lanes read it: the ordered consumers recreate
// themselves on the new stream at the old position; the lanes must notice and start over.
func TestIncomingRecreatedUnderRunningLanes(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		devs := devices(20)
		for _, d := range devs {
			f.groups.set(d, "g")
		}
		// A short check, so that a lane comparing its stream with another's incarnation would
		// restart many times during the test.
		pool, _ := f.runAll(lanes.Config{IncarnationCheck: 100 * time.Millisecond})
		f.publish(devs, 100, nil)
		f.read("OUTGOING", 2000)

		f.recreateIncoming()
		f.publishFrom(devs, 100, 25, nil)
		f.waitOrDump(pool, "OUTGOING", 2500, time.Minute)
		msgs := f.read("OUTGOING", 2500)
		checkOrder(t, msgs, devs, 125, func(d string) string { return "outgoing.g." + d + ".evt" })
		var hdrs []nats.Header
		for _, m := range msgs[2000:] {
			hdrs = append(hdrs, m.Headers())
		}
		f.checkIDs(hdrs)
		// Exactly the lanes whose stream was re-created start over, each of them, busy or idle.
		recreated := func(p int) bool { return f.names.StreamLayout == subjects.SingleStream || p%2 == 0 }
		natstest.Eventually(t, 10*time.Second, func() error {
			for p := range f.lay.Partitions {
				if recreated(p) && f.recreated[p].Load() == 0 {
					return fmt.Errorf("the lane of partition %d has not started over on its re-created stream", p)
				}
			}
			return nil
		})
		for p := range f.lay.Partitions {
			if n := f.recreated[p].Load(); !recreated(p) && n != 0 {
				t.Errorf("the lane of partition %d ended %d times with ErrIncomingRecreated; its stream was not re-created", p, n)
			}
		}
	})
}

// A checkpoint written before checkpoints named their stream (a bare sequence) is taken as the
// current INCOMING's: the lane resumes after it and writes it back in the new form.
func TestBareCheckpointIsTheCurrentStreams(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-old"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	f.publish([]string{dev}, 10, nil) // INCOMING 1..10, all of partition p
	if _, err := f.ctl.PutString(context.Background(), wire.CheckpointKey(p), "6"); err != nil {
		t.Fatal(err)
	}
	f.run(lanes.Config{}, nil)
	msgs := f.read("OUTGOING", 4)
	for i, m := range msgs {
		if want := fmt.Sprintf("%s:%d", dev, 6+i); string(m.Data()) != want {
			t.Fatalf("OUTGOING message %d = %q, want %q: the lane must resume after the bare checkpoint 6", i, m.Data(), want)
		}
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		e, err := f.ctl.Get(context.Background(), wire.CheckpointKey(p))
		if err != nil {
			return err
		}
		if cp, err := wire.ParseCheckpoint(e.Value()); err != nil || cp.Incarnation == "" || cp.Seq != 10 {
			return fmt.Errorf("checkpoint = %q (%+v, %v), want <incarnation>:10", e.Value(), cp, err)
		}
		return nil
	})
}
