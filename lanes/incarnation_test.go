package lanes_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
)

// runAll runs every partition in a pool like an owner that keeps its leases: a lane that ends
// with an error other than its context's is started again, as the election does after a
// backoff. It returns the pool and a func that stops every lane and waits for them.
func (f *fixture) runAll(cfg lanes.Config) (*lanes.Pool, func()) {
	f.t.Helper()
	cfg.Layout = f.lay
	if cfg.CheckpointInterval == 0 {
		cfg.CheckpointInterval = 20 * time.Millisecond
	}
	pool, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
	if err != nil {
		f.t.Fatalf("lanes.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for p := range f.lay.Partitions {
		wg.Go(func() {
			for ctx.Err() == nil {
				err := pool.Run(ctx, lanes.Assignment{Partition: p, Epoch: uint64(100 + p)})
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
// again at 1.
func (f *fixture) recreateIncoming() {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.js.DeleteStream(ctx, "INCOMING"); err != nil {
		f.t.Fatalf("DeleteStream(INCOMING): %v", err)
	}
	if _, err := setup.Ensure(ctx, f.js, setup.Config{Layout: f.lay}); err != nil {
		f.t.Fatalf("setup.Ensure: %v", err)
	}
}

// msgID is the Nats-Msg-Id of INCOMING sequence seq, in INCOMING as it is now.
func (f *fixture) msgID(seq uint64) string {
	f.t.Helper()
	s, err := f.js.Stream(context.Background(), "INCOMING")
	if err != nil {
		f.t.Fatal(err)
	}
	return lanes.MsgIDPrefix("INCOMING", lanes.Incarnation(s.CachedInfo().Created)) + strconv.FormatUint(seq, 10)
}

// checkIDs checks that every message carries a Nats-Msg-Id of INCOMING's current incarnation.
func (f *fixture) checkIDs(msgs []nats.Header) {
	f.t.Helper()
	s, err := f.js.Stream(context.Background(), "INCOMING")
	if err != nil {
		f.t.Fatal(err)
	}
	prefix := lanes.MsgIDPrefix("INCOMING", lanes.Incarnation(s.CachedInfo().Created))
	for i, h := range msgs {
		if id := h.Get(nats.MsgIdHdr); !strings.HasPrefix(id, prefix) {
			f.t.Fatalf("message %d after INCOMING was re-created: Nats-Msg-Id %q, want prefix %q", i, id, prefix)
		}
	}
}

// The user's path: stop kvmapper, delete INCOMING, run setup, start again, publish. The
// checkpoints hold the old stream's sequences; honouring them would skip the new stream's
// first messages, and reusing the old Msg-Ids would have OUTGOING drop them as duplicates.
func TestIncomingRecreatedWhileStopped(t *testing.T) {
	f := newFixture(t)
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
}

// INCOMING deleted and created again while the lanes read it: the ordered consumers recreate
// themselves on the new stream at the old position; the lanes must notice and start over.
func TestIncomingRecreatedUnderRunningLanes(t *testing.T) {
	f := newFixture(t)
	devs := devices(20)
	for _, d := range devs {
		f.groups.set(d, "g")
	}
	pool, _ := f.runAll(lanes.Config{})
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
}
