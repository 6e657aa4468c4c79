package lanes_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// droppingPool is a pool on a connection of its own, whose publishes drop can make vanish.
func (f *fixture) droppingPool(cfg lanes.Config) (*lanes.Pool, *natstest.Dropper) {
	f.t.Helper()
	drop := &natstest.Dropper{}
	_, js := f.srv.JetStream(f.t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond),
		nats.ReconnectBufSize(-1), nats.SetCustomDialer(drop))
	ctl, err := js.KeyValue(context.Background(), "kvmapper")
	if err != nil {
		f.t.Fatal(err)
	}
	pool, err := lanes.New(js, ctl, f.groups.lookup, f.config(cfg))
	if err != nil {
		f.t.Fatal(err)
	}
	return pool, drop
}

// A checkpoint write whose answer does not come (a replicated control bucket electing a leader
// answers nothing for seconds; the write gives up after 5s) must not hold the lane up: messages
// keep being mapped meanwhile, and once the bucket answers again the checkpoint catches up.
func TestUnansweredCheckpointWriteDoesNotBlockTheLane(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	f := newFixture(t)
	dev := "dev-1"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	// The lane's checkpoint writes are to go unanswered.
	pool, drop := f.droppingPool(lanes.Config{CheckpointInterval: 20 * time.Millisecond})
	_, res := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1})
	natstest.Eventually(t, 10*time.Second, func() error {
		if len(pool.Partitions()) != 1 {
			return fmt.Errorf("the lane has not fenced yet")
		}
		return nil
	})
	f.publish([]string{dev}, 1, nil)
	natstest.Eventually(t, 10*time.Second, func() error {
		if cp := f.checkpoint(p); cp != 1 {
			return fmt.Errorf("checkpoint %d, want 1", cp)
		}
		return nil
	})

	drop.Drop("$KV.kvmapper." + wire.CheckpointKey(p))
	f.publishFrom([]string{dev}, 1, 1, nil) // moves the prefix: the next tick's write goes unanswered
	natstest.Eventually(t, 10*time.Second, func() error {
		if drop.Dropped() == 0 {
			return fmt.Errorf("no checkpoint write sent yet")
		}
		return nil
	})
	start := time.Now()
	f.publishFrom([]string{dev}, 2, 1, nil)
	checkOrder(t, f.read("OUTGOING", 3), []string{dev}, 3, func(string) string { return "outgoing.g.dev-1.evt" })
	// A lane that waited for its write would map this one only when the write gave up, 5s after
	// it was sent; mapping it takes milliseconds.
	if took := time.Since(start); took > 2500*time.Millisecond {
		t.Errorf("a message published while a checkpoint write waited for its answer was mapped after %v, want well below the write's 5s timeout", took)
	}
	t.Logf("mapped %v after publishing, while the checkpoint write waited", time.Since(start))

	drop.Drop("")
	natstest.Eventually(t, 20*time.Second, func() error {
		if cp := f.checkpoint(p); cp != 3 {
			return fmt.Errorf("checkpoint %d, want 3 once the bucket answers again", cp)
		}
		return nil
	})
	select {
	case err := <-res:
		t.Fatalf("Run = %v while the lane owned the partition: an unanswered write is not a fence", err)
	default:
	}
}
