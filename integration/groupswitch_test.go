package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	replica "github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// inprocReplica is one replica run in this process by package mapper (imported as replica), exactly as `kvmapper run`
// wires it, so that a test can reach inside it (hold its groups watch back).
type inprocReplica struct {
	*replica.Replica
	stop func() // cancels Run and waits for it (a graceful stop, as SIGTERM); idempotent
}

// startInprocReplica runs replica id on its own connection until stop or the end of the test,
// and returns once its groups table is loaded and it takes part in the election.
func (e *env) startInprocReplica(id string, kcfg kv.Config) *inprocReplica {
	e.t.Helper()
	t := e.t
	_, js := e.srv.JetStream(t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1))
	lay := layout(t)
	scfg := setup.Config{Layout: lay}
	scfg.Defaults()
	r, err := replica.New(context.Background(), js, replica.Config{
		ID:    id,
		Setup: scfg,
		Table: kcfg,
		Lanes: lanes.Config{Layout: lay, CheckpointInterval: 50 * time.Millisecond,
			PublishTimeout: 2 * time.Second, DrainTimeout: 5 * time.Second},
		Election: election.Config{LeaseTTL: time.Second, RenewInterval: 200 * time.Millisecond, Grace: time.Second},
	})
	if err != nil {
		t.Fatalf("replica.New(%s): %v", id, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() { done <- r.Run(ctx, func() { close(ready) }) }()
	var once sync.Once
	ir := &inprocReplica{Replica: r, stop: func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("%s: Run() = %v, want nil", id, err)
				}
			case <-time.After(60 * time.Second):
				t.Errorf("%s: Run did not return within 60s of cancel", id)
			}
		})
	}}
	t.Cleanup(ir.stop)
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("%s: Run() = %v before its groups table was loaded", id, err)
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: groups table not loaded within 30s", id)
	}
	return ir
}

// keptByFirst returns a device whose partition replica "a", owning every partition, keeps when
// "b" joins (election.Plan is what the replicas follow), so that the test decides when it moves.
func keptByFirst(t *testing.T) string {
	owners := slices.Repeat([]string{"a"}, partitions)
	_, release := election.Plan("a", []string{"a", "b"}, owners)
	for i := range 1000 {
		dev := fmt.Sprintf("dev-%d", i)
		if !slices.Contains(release, subjects.Partition(dev, partitions)) {
			return dev
		}
	}
	t.Fatal("no device whose partition A keeps")
	return ""
}

// TestGroupSwitchSurvivesHandoverToALaggingReplica checks I4 across a handover: replica B takes a
// partition over while its groups watch has not applied the move replica A already mapped with,
// and must map nothing of the moved device until it has; then everything lands in the new group,
// in order, and nothing after the switch in the old one.
func TestGroupSwitchSurvivesHandoverToALaggingReplica(t *testing.T) {
	e := newEnv(t)
	dev := keptByFirst(t)
	p := subjects.Partition(dev, partitions)
	e.put(dev, "group-a")

	a := e.startInprocReplica("a", kv.Config{})
	natstest.Eventually(t, 30*time.Second, func() error {
		if n := len(a.Owned()); n != partitions {
			return fmt.Errorf("A owns %d partitions, want all %d", n, partitions)
		}
		return nil
	})
	// B's watch parks on the key "barrier" until the test releases it: every later update,
	// the move of dev-42 among them, stays unapplied by B.
	reached, gate := make(chan struct{}), make(chan struct{})
	var reachedOnce, gateOnce sync.Once
	release := func() { gateOnce.Do(func() { close(gate) }) }
	b := e.startInprocReplica("b", kv.Config{RetryMin: 10 * time.Millisecond, OnUpdate: func(u kv.Update) {
		if u.Device == "barrier" {
			reachedOnce.Do(func() { close(reached) })
			<-gate
		}
	}})
	t.Cleanup(release) // runs before B is stopped, which waits for the watch
	natstest.Eventually(t, 30*time.Second, func() error {
		if na, nb := len(a.Owned()), len(b.Owned()); na != partitions/2 || nb != partitions/2 {
			return fmt.Errorf("A owns %d partitions, B %d; want %d each", na, nb, partitions/2)
		}
		return nil
	})
	if !slices.Contains(a.Owned(), p) {
		t.Fatalf("A owns %v after B joined, not partition %d of %s", a.Owned(), p, dev)
	}
	ld := newLoad(t, e.js)
	ld.publish([]string{dev}, 5) // messages 0–4, before the switch
	e.readStream("OUTGOING", 5, 30*time.Second)

	e.put("barrier", "x")
	select {
	case <-reached:
	case <-time.After(30 * time.Second):
		t.Fatal("B's watch did not reach the barrier within 30s")
	}
	e.put(dev, "group-b")
	natstest.Eventually(t, 30*time.Second, func() error {
		if got, _ := a.Lookup(dev); got.Group != "group-b" {
			return fmt.Errorf("A: Lookup(%s) = %+v, want group-b", dev, got)
		}
		return nil
	})
	if got, _ := b.Lookup(dev); got.Group != "group-a" {
		t.Fatalf("B: Lookup(%s) = %+v while its watch is held, want group-a", dev, got)
	}
	ld.publish([]string{dev}, 5) // messages 5–9, mapped by A after the switch
	e.readStream("OUTGOING", 10, 30*time.Second)

	// Hand everything over to B: A leaves the way SIGTERM makes it, deleting its leases.
	a.stop()
	natstest.Eventually(t, 30*time.Second, func() error {
		if !slices.Contains(b.Owned(), p) {
			return fmt.Errorf("B owns %v, not partition %d of %s yet", b.Owned(), p, dev)
		}
		return nil
	})
	ld.publish([]string{dev}, 5) // messages 10–14, INCOMING only while B's table lags

	// B holds the lease; its table still says group-a. For a sustained window, nothing more of
	// dev-42 may reach OUTGOING.
	window := time.Now().Add(3 * time.Second)
	for time.Now().Before(window) {
		if n := e.count("OUTGOING"); n != 10 {
			msgs := e.readStream("OUTGOING", n, time.Second)
			var late []string
			for _, m := range msgs[10:] {
				late = append(late, fmt.Sprintf("%s %q", m.Subject(), m.Data()))
			}
			t.Fatalf("OUTGOING holds %d messages while B's groups table lags, want 10; mapped by B: %s",
				n, strings.Join(late, ", "))
		}
		poll := time.NewTimer(50 * time.Millisecond)
		<-poll.C
	}

	release()
	msgs := e.readStream("OUTGOING", 15, 30*time.Second)
	got := perDevice(t, msgs, map[string]int{dev: 15})[dev]
	for i, subj := range got {
		want := "outgoing.group-a." + dev + ".evt"
		if i >= 5 {
			want = "outgoing.group-b." + dev + ".evt"
		}
		if subj != want {
			t.Errorf("message %d of %s on %s, want %s", i, dev, subj, want)
		}
	}
}
