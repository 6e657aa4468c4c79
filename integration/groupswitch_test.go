package integration

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	replica "github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// inprocReplica is one replica run in this process by package mapper (imported as replica), exactly as `kvmapper run`
// wires it, so that a test can reach inside it (hold its groups watch back).
type inprocReplica struct {
	*replica.Replica
	stop func() // cancels Run and waits for it (a graceful stop, as SIGTERM); idempotent
}

// startInprocReplica runs replica id on its own connection until stop or the end of the test,
// and returns once its groups table is loaded and it takes part in the election.
// mods change its configuration before it is built.
func (e *env) startInprocReplica(id string, kcfg kv.Config, mods ...func(*replica.Config)) *inprocReplica {
	e.t.Helper()
	t := e.t
	_, js := e.srv.JetStream(t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1))
	lay := layout(t)
	scfg := setup.Config{Layout: lay}
	scfg.Defaults()
	cfg := replica.Config{
		ID:    id,
		Setup: scfg,
		Table: kcfg,
		Lanes: lanes.Config{Layout: lay, CheckpointInterval: 50 * time.Millisecond,
			PublishTimeout: 2 * time.Second, DrainTimeout: 5 * time.Second},
		Election: election.Config{LeaseTTL: time.Second, RenewInterval: 200 * time.Millisecond, Grace: time.Second},
	}
	for _, mod := range mods {
		mod(&cfg)
	}
	r, err := replica.New(context.Background(), js, cfg)
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

// laggingScene is the scene of the tests of a partition handed to a replica whose table lags: replica A, owning every partition
// at first, has mapped dev (a device whose partition it keeps when B joins) with group-a, then
// with group-b; replica B, joined, still sees group-a, its groups watch held at a key before the
// move until release is called. mods configure both replicas.
type laggingScene struct {
	a, b    *inprocReplica
	dev     string
	p       int
	release func()
}

func newLaggingScene(t *testing.T, e *env, dev string, publish func(n int), mods ...func(*replica.Config)) *laggingScene {
	t.Helper()
	h := &laggingScene{dev: dev}
	h.p = subjects.Partition(h.dev, partitions)
	e.put(h.dev, "group-a")

	h.a = e.startInprocReplica("a", kv.Config{}, mods...)
	natstest.Eventually(t, 30*time.Second, func() error {
		if n := len(h.a.Owned()); n != partitions {
			return fmt.Errorf("A owns %d partitions, want all %d", n, partitions)
		}
		return nil
	})
	// B's watch parks on the key "barrier" until the test releases it: every later update,
	// the move of the device among them, stays unapplied by B.
	reached, gate := make(chan struct{}), make(chan struct{})
	var reachedOnce, gateOnce sync.Once
	h.release = func() { gateOnce.Do(func() { close(gate) }) }
	h.b = e.startInprocReplica("b", kv.Config{RetryMin: 10 * time.Millisecond, OnUpdate: func(u kv.Update) {
		if u.Device == "barrier" {
			reachedOnce.Do(func() { close(reached) })
			<-gate
		}
	}}, mods...)
	t.Cleanup(h.release) // runs before B is stopped, which waits for the watch
	natstest.Eventually(t, 30*time.Second, func() error {
		if na, nb := len(h.a.Owned()), len(h.b.Owned()); na != partitions/2 || nb != partitions/2 {
			return fmt.Errorf("A owns %d partitions, B %d; want %d each", na, nb, partitions/2)
		}
		return nil
	})
	if !slices.Contains(h.a.Owned(), h.p) {
		t.Fatalf("A owns %v after B joined, not partition %d of %s", h.a.Owned(), h.p, h.dev)
	}
	publish(5) // messages 0–4, before the switch
	e.readStream("OUTGOING", 5, 30*time.Second)

	e.put("barrier", "x")
	select {
	case <-reached:
	case <-time.After(30 * time.Second):
		t.Fatal("B's watch did not reach the barrier within 30s")
	}
	e.put(h.dev, "group-b")
	natstest.Eventually(t, 30*time.Second, func() error {
		if got, _ := h.a.Lookup(h.dev); got.Group != "group-b" {
			return fmt.Errorf("A: Lookup(%s) = %+v, want group-b", h.dev, got)
		}
		return nil
	})
	if got, _ := h.b.Lookup(h.dev); got.Group != "group-a" {
		t.Fatalf("B: Lookup(%s) = %+v while its watch is held, want group-a", h.dev, got)
	}
	publish(5) // messages 5–9, mapped by A after the switch
	e.readStream("OUTGOING", 10, 30*time.Second)

	// Hand everything over to B: A leaves the way SIGTERM makes it, deleting its leases.
	h.a.stop()
	natstest.Eventually(t, 30*time.Second, func() error {
		if !slices.Contains(h.b.Owned(), h.p) {
			return fmt.Errorf("B owns %v, not partition %d of %s yet", h.b.Owned(), h.p, h.dev)
		}
		return nil
	})
	return h
}

// holdsNoMore fails t if OUTGOING holds more than n messages at any moment of a sustained
// window: B holds the lease while its table still says group-a.
func (h *laggingScene) holdsNoMore(t *testing.T, e *env, n int) {
	t.Helper()
	window := time.Now().Add(3 * time.Second)
	for time.Now().Before(window) {
		if got := e.count("OUTGOING"); got != n {
			msgs := e.readStream("OUTGOING", got, time.Second)
			var late []string
			for _, m := range msgs[n:] {
				late = append(late, fmt.Sprintf("%s %q", m.Subject(), m.Data()))
			}
			t.Fatalf("OUTGOING holds %d messages while B's groups table lags, want %d; mapped by B: %s",
				got, n, strings.Join(late, ", "))
		}
		poll := time.NewTimer(50 * time.Millisecond)
		<-poll.C
	}
}

// checkSwitch checks that the device's 15 messages went to group-a up to message 4, then to
// group-b.
func (h *laggingScene) checkSwitch(t *testing.T, e *env) {
	t.Helper()
	msgs := e.readStream("OUTGOING", 15, 30*time.Second)
	got := perDevice(t, msgs, map[string]int{h.dev: 15})[h.dev]
	for i, subj := range got {
		want := "outgoing.group-a." + h.dev + ".evt"
		if i >= 5 {
			want = "outgoing.group-b." + h.dev + ".evt"
		}
		if subj != want {
			t.Errorf("message %d of %s on %s, want %s", i, h.dev, subj, want)
		}
	}
}

// TestGroupSwitchSurvivesHandoverToALaggingReplica checks I4 across a handover: replica B takes a
// partition over while its groups watch has not applied the move replica A already mapped with,
// and must map nothing of the moved device until it has; then everything lands in the new group,
// in order, and nothing after the switch in the old one.
func TestGroupSwitchSurvivesHandoverToALaggingReplica(t *testing.T) {
	e := newEnv(t)
	ld := newLoad(t, e.js)
	dev := keptByFirst(t)
	h := newLaggingScene(t, e, dev, func(n int) { ld.publish([]string{dev}, n) })
	ld.publish([]string{dev}, 5) // messages 10–14, INCOMING only while B's table lags
	h.holdsNoMore(t, e, 10)
	h.release()
	h.checkSwitch(t, e)
}

// TestDirectGroupSwitchSurvivesHandoffToALaggingReplica is the same in direct mode: B, told by A
// in the handoff that A's table was at a later revision than its own, catches its table up before
// it forwards anything of the partition; what the device publishes meanwhile waits in B's queue
// and gets its PubAck once B has caught up.
func TestDirectGroupSwitchSurvivesHandoffToALaggingReplica(t *testing.T) {
	e := newDirectEnv(t, wire.ReceiveMapping)
	dev := keptByFirst(t)
	next := 0
	msg := func() *nats.Msg {
		m := nats.NewMsg("incoming." + dev + ".evt")
		m.Data = []byte(dev + ":" + strconv.Itoa(next))
		next++
		return m
	}
	publish := func(n int) {
		t.Helper()
		for range n {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			ack, err := e.js.PublishMsg(ctx, msg())
			cancel()
			if err != nil || ack.Stream != "OUTGOING" {
				t.Fatalf("Publish = %+v, %v; want OUTGOING's PubAck", ack, err)
			}
		}
	}
	direct := func(c *replica.Config) { c.Setup.Mode, c.Setup.Receive = wire.ModeDirect, wire.ReceiveMapping }
	h := newLaggingScene(t, e, dev, publish, direct)
	// Messages 10–14 reach B while its table lags: no PubAck, nothing stored, until it caught up.
	var futs []jetstream.PubAckFuture
	for range 5 {
		f, err := e.js.PublishMsgAsync(msg())
		if err != nil {
			t.Fatal(err)
		}
		futs = append(futs, f)
	}
	h.holdsNoMore(t, e, 10)
	h.release()
	for i, f := range futs {
		select {
		case ack := <-f.Ok():
			if ack.Stream != "OUTGOING" {
				t.Errorf("message %d: PubAck from %s, want OUTGOING", 10+i, ack.Stream)
			}
		case err := <-f.Err():
			t.Errorf("message %d: %v, want OUTGOING's PubAck once B caught up", 10+i, err)
		case <-time.After(30 * time.Second):
			t.Fatalf("message %d: no PubAck within 30s of B's table being released", 10+i)
		}
	}
	h.checkSwitch(t, e)
}
