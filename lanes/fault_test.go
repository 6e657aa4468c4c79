package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func TestReleasedWhileResendingStopsPromptly(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.groups.set("dev-1", "g")
	pool, stop := f.run(lanes.Config{DrainTimeout: time.Second, MaxRetryBackoff: 50 * time.Millisecond}, nil)
	if err := f.js.DeleteStream(context.Background(), "OUTGOING"); err != nil {
		t.Fatal(err)
	}
	f.publish([]string{"dev-1"}, 5, nil)
	natstest.Eventually(t, 10*time.Second, func() error {
		if pool.Stats().Failures == 0 {
			return errors.New("no publish failure yet")
		}
		return nil
	})
	done := make(chan map[int]error, 1)
	go func() { done <- stop() }()
	select {
	case errs := <-done:
		for p, err := range errs {
			if err != nil {
				t.Errorf("Run(%d) = %v, want nil after a release", p, err)
			}
		}
	case <-time.After(10 * time.Second):
		t.Fatal("lanes did not stop within 10s of their release while resending (DrainTimeout 1s)")
	}
}

func TestDeadLetterRefusedByUnmapped(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		maxMsgSize int32
		stored     bool // the stripped dead letter fits
	}{
		"stripped": {maxMsgSize: 400, stored: true},
		"gives up": {maxMsgSize: 16, stored: false},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			ctx := context.Background()
			s, err := f.js.Stream(ctx, "UNMAPPED")
			if err != nil {
				t.Fatal(err)
			}
			cfg := s.CachedInfo().Config
			cfg.MaxMsgSize = tc.maxMsgSize
			if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
				t.Fatal(err)
			}
			f.groups.set("good", "g")
			pool, _ := f.run(lanes.Config{MaxRetryBackoff: 50 * time.Millisecond}, nil)
			big := []byte("nobody:0:" + strings.Repeat("x", 1000))
			if _, err := f.js.Publish(ctx, "incoming.nobody.evt", big); err != nil {
				t.Fatal(err)
			}
			f.publish([]string{"good"}, 3, nil)
			// The partition is not blocked: later messages still go through.
			checkOrder(t, f.read("OUTGOING", 3), []string{"good"}, 3, func(string) string { return "outgoing.g.good.evt" })
			if tc.stored {
				dl := f.read("UNMAPPED", 1)[0]
				h := dl.Headers()
				if len(dl.Data()) != 0 || h.Get(wire.HeaderReason) != wire.ReasonNoMapping || h.Get("Nats-Msg-Id") != f.msgID("nobody", 1) || h.Get(wire.HeaderError) == "" {
					t.Errorf("stripped dead letter: %d bytes, headers %v", len(dl.Data()), h)
				}
				return
			}
			natstest.Eventually(t, 10*time.Second, func() error {
				if n := pool.Stats().Dropped; n != 1 {
					return fmt.Errorf("Stats().Dropped = %d, want 1", n)
				}
				return nil
			})
		})
	}
}

// A lane whose checkpoint cannot be written stops taking new messages after MaxCheckpointAge,
// so a takeover never has to resend more than OUTGOING's duplicate window recognises.
func TestStaleCheckpointPausesIntake(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.groups.set("dev-1", "g")
	const tick = 20 * time.Millisecond
	pool, _ := f.run(lanes.Config{MaxCheckpointAge: 200 * time.Millisecond, CheckpointInterval: tick}, nil)
	f.publish([]string{"dev-1"}, 1, nil)
	f.read("OUTGOING", 1)
	ctx := context.Background()
	// Every publish of the lane, as it goes out.
	sent := make(chan *nats.Msg, 100_000)
	watcher := f.srv.Connect(t)
	if _, err := watcher.ChanSubscribe("outgoing.>", sent); err != nil {
		t.Fatal(err)
	}
	if err := watcher.Flush(); err != nil {
		t.Fatal(err)
	}
	// A sealed stream refuses every write at once: checkpoint writes fail, publishing does not.
	s, err := f.js.Stream(ctx, "KV_kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.Sealed = true
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	const more = 20_000
	f.publishFrom([]string{"dev-1"}, 1, more, nil)
	// Paused: nothing at all is sent for a whole second (50 checkpoint ticks, 5 × the maximum
	// age), watched without a gap, short of what INCOMING holds. (Without the pause the lane
	// maps all of it: publishing to OUTGOING still works.)
	const quiet = time.Second
	n := 0
	deadline := time.Now().Add(30 * time.Second)
	for silence := time.NewTimer(quiet); ; {
		select {
		case <-sent:
			n++
			if time.Now().After(deadline) {
				t.Fatalf("the lane still sends after 30s (%d sent): it never paused without checkpoints", n)
			}
			silence.Reset(quiet)
			continue
		case <-silence.C:
		}
		break
	}
	if n >= more {
		t.Fatalf("the lane sent all %d messages: it never paused without checkpoints", n)
	}
	// The lane is alive, with messages waiting: paused, not dead.
	p := subjects.Partition("dev-1", 16)
	for _, st := range pool.Partitions() {
		if st.Partition == p && st.Pending == 0 {
			t.Errorf("lane %d: %+v, want messages pending behind the pause", p, st)
		}
	}
	t.Logf("paused after %d of %d messages", n, more)
}

// An idle lane writes no checkpoint, since nothing moved. After an idle spell longer than
// MaxCheckpointAge, the first message moves the prefix past the checkpoint; the next one must
// still be taken at once, not wait for the next tick's write.
func TestIdleLaneMapsAtOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.groups.set("dev-1", "g")
	const age, tick = 2 * time.Second, time.Minute
	pool, _ := f.run(lanes.Config{MaxCheckpointAge: age, CheckpointInterval: tick}, nil)
	natstest.Eventually(t, 10*time.Second, func() error {
		if n := len(pool.Partitions()); n != 16 {
			return fmt.Errorf("%d lanes running, want 16", n)
		}
		return nil
	})
	// The scenario, not a synchronisation: the lanes stay idle past MaxCheckpointAge.
	idle := time.NewTimer(age + time.Second)
	<-idle.C
	f.publish([]string{"dev-1"}, 1, nil)
	f.read("OUTGOING", 1)
	start := time.Now()
	f.publishFrom([]string{"dev-1"}, 1, 1, nil)
	f.waitOrDump(pool, "OUTGOING", 2, 15*time.Second) // the next tick is a minute away
	checkOrder(t, f.read("OUTGOING", 2), []string{"dev-1"}, 2, func(string) string { return "outgoing.g.dev-1.evt" })
	t.Logf("the second message after an idle spell was mapped in %v", time.Since(start))
}

// A lane whose consumer is gone creates another, under a new name, from the message after the
// last it handed on. On a cluster, a consumer created within seconds of a server's crash can be
// placed on that server, and its creation is never answered. Here the creations go unanswered for
// 3s: the lane must give each up after a short while and try again, so that it reads on soon
// after they are answered again, not after a 10s timeout of nats.go's ordered consumer (which
// retries one name for ever), and its new consumer must have a new name.
func TestUnansweredConsumerCreationIsRetried(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	unansweredCreations(t, 3*time.Second, 5*time.Second)
}

// A server's crash that takes the JetStream meta leader with it leaves every consumer creation
// unanswered until the next meta leader is elected, 4-9 s later (a clean-clone CI run: 8.6 s).
// Here they go unanswered for 8.5 s: the lane's creations, each given up after its timeout, must
// not have grown so long that it reads on only many seconds after they are answered again (with
// timeouts doubling from the second up to 10 s, the lane tried again 7.5 s after). Its timeouts
// stop at 4 s: it reads on within them, and the bound allows 1 s more.
func TestConsumerCreationAfterAMetaElection(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	unansweredCreations(t, 8500*time.Millisecond, 5*time.Second)
}

// unansweredCreations deletes a running lane's consumer, leaves every consumer creation of the
// lane unanswered for unanswered from the first it tries, and fails t unless the lane reads on
// within within of their being answered again, in order and through a consumer of a new name.
func unansweredCreations(t *testing.T, unanswered, within time.Duration) {
	f := newFixture(t)
	dev := "dev-1"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	pool, drop := f.droppingPool(lanes.Config{RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 100 * time.Millisecond})
	runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1})
	f.publish([]string{dev}, 1, nil)
	f.read("OUTGOING", 1)

	ctx := context.Background()
	s, err := f.js.Stream(ctx, "INCOMING")
	if err != nil {
		t.Fatal(err)
	}
	names := func() []string {
		var names []string
		for c := range s.ListConsumers(ctx).Info() {
			names = append(names, c.Name)
		}
		return names
	}
	first := names()
	if len(first) != 1 {
		t.Fatalf("INCOMING's consumers are %q, want the lane's one", first)
	}
	drop.Drop("$JS.API.CONSUMER.CREATE.")
	if err := s.DeleteConsumer(ctx, first[0]); err != nil {
		t.Fatal(err)
	}
	f.publishFrom([]string{dev}, 1, 1, nil)
	natstest.Eventually(t, 10*time.Second, func() error {
		if drop.Dropped() == 0 {
			return errors.New("the lane has not tried to create a consumer yet")
		}
		return nil
	})
	// The scenario, not a synchronisation: creations go unanswered for a while.
	timer := time.NewTimer(unanswered)
	<-timer.C
	drop.Drop("")
	answered := time.Now()
	f.waitOrDump(pool, "OUTGOING", 2, 30*time.Second)
	took := time.Since(answered)
	if took > within {
		t.Errorf("the lane read on %v after its consumer creations were answered again (unanswered for %v), want within %v", took, unanswered, within)
	}
	checkOrder(t, f.read("OUTGOING", 2), []string{dev}, 2, func(string) string { return "outgoing.g.dev-1.evt" })
	if now := names(); len(now) != 1 || now[0] == first[0] {
		t.Fatalf("INCOMING's consumers are %q after %q was deleted, want one under a new name", now, first[0])
	}
	t.Logf("%d consumer creations unanswered; read on %v after they were answered again", drop.Dropped(), took)
}
