package direct_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// A group change the old owner has mapped with is never undone by a new owner whose table lags:
// the new owner, told the old one's table revision, catches up before it forwards anything (I4).
func TestHandoffToALaggingTableKeepsTheSwitch(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	dev := "dev-1"
	part := partOf(dev)
	// A's table has moved dev-1 to group-b (revision 2); B's still says group-a (revision 1)
	// until its CatchUp, which the test holds until B calls it.
	ta, tb := newGroups(), newGroups()
	ta.set(dev, "group-a")
	ta.set(dev, "group-b")
	tb.set(dev, "group-a")
	caughtUp := make(chan struct{})
	a := f.pool("a", ta.lookup, func(c *direct.Config) {
		c.Revision, c.CatchUp = ta.revision, func(context.Context) error { return nil }
	})
	b := f.pool("b", tb.lookup, func(c *direct.Config) {
		c.Revision = tb.revision
		c.CatchUp = func(ctx context.Context) error {
			tb.set(dev, "group-b")
			close(caughtUp)
			return nil
		}
	})
	ra := f.run(a, direct.Assignment{Partition: part, Epoch: 1})
	pubs := f.startPublishers([]string{dev})
	pubs.waitSent(100)
	ra.release(t)
	f.run(b, direct.Assignment{Partition: part, Epoch: 2})
	pubs.waitSent(100)
	sent := pubs.halt()
	msgs := f.stream("OUTGOING")
	inOrder(t, msgs, sent)
	for i, m := range msgs {
		if m.Subject() != "outgoing.group-b."+dev+".temp" {
			t.Fatalf("message %d went to %s after the switch to group-b", i, m.Subject())
		}
	}
	select {
	case <-caughtUp:
	default:
		t.Fatal("B never caught its table up with A's revision")
	}
}

// A released partition nobody announces itself for stops after HandoffTimeout; a later owner
// finds nobody to take over from, and serves at once.
func TestHandoffTimeout(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	f.groups.set("dev-1", "g")
	part := partOf("dev-1")
	a := f.pool("a", nil, func(c *direct.Config) { c.HandoffTimeout = 300 * time.Millisecond })
	ra := f.run(a, direct.Assignment{Partition: part, Epoch: 1})
	ra.release(t)
	// Still forwarded while it waits for a next owner…
	if ack, err := f.js.Publish(context.Background(), "incoming.dev-1.temp", []byte("0")); err != nil || ack.Stream != "OUTGOING" {
		t.Fatalf("Publish while handing over = %+v, %v; want OUTGOING's acknowledgement", ack, err)
	}
	// …then not any more.
	natstest.Eventually(t, 10*time.Second, func() error {
		if n := a.Stats().Lingering; n != 0 {
			return fmt.Errorf("%d partitions still handing over", n)
		}
		return nil
	})
	if _, err := f.js.Publish(context.Background(), "incoming.dev-1.temp", nil, jetstream.WithRetryAttempts(0)); !errors.Is(err, jetstream.ErrNoStreamResponse) {
		t.Fatalf("Publish after the handoff timeout = %v, want no responders", err)
	}
	b := f.pool("b", nil, nil)
	start := time.Now()
	f.run(b, direct.Assignment{Partition: part, Epoch: 2})
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("B took %v to serve with nobody to take over from; the answer timeout is 2s", d)
	}
	if ack, err := f.js.Publish(context.Background(), "incoming.dev-1.temp", []byte("1")); err != nil || ack.Stream != "OUTGOING" {
		t.Fatalf("Publish to the new owner = %+v, %v", ack, err)
	}
}

// A previous owner killed in the middle of a handoff (kill -9 after the new owner's announcement
// reached it, before its answer got out) does not hold the partition up for the new owner's
// whole AnswerTimeout: its subscriptions went with its connection, and the new owner's next
// announcement gets no responders. The old owner's answer is lost on its way
// (natstest.Dropper), then its connection is closed; with an AnswerTimeout of 10 s the new owner
// must serve, and a device get its PubAck, within half of it.
func TestOwnerKilledMidHandoff(t *testing.T) {
	eachReceive(t, func(t *testing.T, f *fixture) {
		f.groups.set("dev-1", "g")
		part := partOf("dev-1")
		drop := &natstest.Dropper{}
		nca := f.srv.Connect(t, nats.ReconnectBufSize(-1), nats.SetCustomDialer(drop))
		a := f.poolOn(nca, "a", nil, nil)
		ra := f.run(a, direct.Assignment{Partition: part, Epoch: 1})
		drop.Drop(nats.InboxPrefix) // the old owner's answer to the announcement
		ra.release(t)
		const answerTimeout = 10 * time.Second
		b := f.pool("b", nil, func(c *direct.Config) { c.AnswerTimeout = answerTimeout })
		asg := direct.Assignment{Partition: part, Epoch: 2}
		start := time.Now()
		rb := f.start(b, asg)
		natstest.Eventually(t, answerTimeout, func() error {
			if drop.Dropped() == 0 {
				return errors.New("the old owner has not answered the new owner's announcement")
			}
			return nil
		})
		nca.Close() // kill -9: the server drops its subscriptions
		rb.waitServed(t, b, asg, 2*answerTimeout)
		if d := time.Since(start); d > answerTimeout/2 {
			t.Errorf("the new owner served %v after the old owner died mid-handoff, want well under its answer timeout (%v)", d.Round(time.Millisecond), answerTimeout)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if ack, err := f.js.Publish(ctx, "incoming.dev-1.temp", []byte("0")); err != nil || ack.Stream != "OUTGOING" {
			t.Fatalf("Publish to the new owner = %+v, %v; want OUTGOING's acknowledgement", ack, err)
		}
	})
}

// With nobody else to take over (the last replica stopping), a released partition stops at once.
func TestAloneStopsWithoutAHandoff(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	f.groups.set("dev-1", "g")
	a := f.pool("a", nil, func(c *direct.Config) { c.Alone = func(context.Context) bool { return true } })
	ra := f.run(a, direct.Assignment{Partition: partOf("dev-1"), Epoch: 1})
	ra.release(t)
	done := make(chan struct{})
	go func() { a.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("Close waited for a handoff although the replica is alone (HandoffTimeout is 5s)")
	}
	if err := a.Run(context.Background(), direct.Assignment{Partition: 0, Epoch: 2}); !errors.Is(err, direct.ErrClosed) {
		t.Errorf("Run after Close = %v, want ErrClosed", err)
	}
}

// A full queue drops what does not fit, counts it and goes on: the publishers of the dropped
// messages get no acknowledgement, everything else flows.
func TestFullQueueDropsAndGoesOn(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	f.groups.set("dev-1", "g")
	gate, entered := make(chan struct{}), make(chan struct{})
	var once sync.Once
	lookup := func(device string) subjects.Mapping {
		if device == "dev-1" {
			once.Do(func() { close(entered); <-gate })
		}
		return f.groups.lookup(device)
	}
	a := f.pool("a", lookup, func(c *direct.Config) { c.QueueMessages = 4 })
	f.run(a, direct.Assignment{Partition: partOf("dev-1"), Epoch: 1})
	var futs []jetstream.PubAckFuture
	for i := range 20 {
		fut, err := f.js.PublishAsync("incoming.dev-1.temp", []byte(strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		futs = append(futs, fut)
		if i == 0 {
			<-entered // the lane is held on the first message: the rest queue up
		}
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		if st := a.Stats(); st.Dropped+uint64(st.Pending) < 19 {
			return fmt.Errorf("%d dropped and %d queued of the 19 behind the held message", st.Dropped, st.Pending)
		}
		return nil
	})
	close(gate)
	// The 5 that fit are acknowledged within milliseconds; the others never are.
	acked := 0 // an acknowledgement is received once: count across polls
	natstest.Eventually(t, 10*time.Second, func() error {
		for _, fut := range futs {
			select {
			case <-fut.Ok():
				acked++
			default:
			}
		}
		if acked < 5 {
			return fmt.Errorf("%d acknowledged", acked)
		}
		return nil
	})
	st := a.Stats()
	if st.Dropped != 15 || acked != 5 {
		t.Errorf("Stats().Dropped = %d and %d acknowledged, want 15 dropped and 5 (the held one and a queue of 4) acknowledged", st.Dropped, acked)
	}
	if ack, err := f.js.Publish(context.Background(), "incoming.dev-1.temp", []byte("after")); err != nil || ack.Stream != "OUTGOING" {
		t.Fatalf("Publish after the overflow = %+v, %v", ack, err)
	}
}

// The queue's byte bound (QueueBytes, 4 MiB by default) drops as its message bound does: with
// 512 KiB messages behind a held one, seven fit in 4 MiB (each also counts its subject and reply),
// the rest are dropped and get no acknowledgement, and the partition goes on.
func TestFullQueueByBytesDropsAndGoesOn(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	f.groups.set("dev-1", "g")
	gate, entered := make(chan struct{}), make(chan struct{})
	var once sync.Once
	lookup := func(device string) subjects.Mapping {
		if device == "dev-1" {
			once.Do(func() { close(entered); <-gate })
		}
		return f.groups.lookup(device)
	}
	a := f.pool("a", lookup, nil) // the default bounds: 16384 messages, 4 MiB
	f.run(a, direct.Assignment{Partition: partOf("dev-1"), Epoch: 1})
	payload := make([]byte, 512<<10)
	var futs []jetstream.PubAckFuture
	for i := range 20 {
		fut, err := f.js.PublishAsync("incoming.dev-1.temp", payload)
		if err != nil {
			t.Fatal(err)
		}
		futs = append(futs, fut)
		if i == 0 {
			<-entered // the lane is held on the first message: the rest queue up
		}
	}
	natstest.Eventually(t, 30*time.Second, func() error {
		if st := a.Stats(); st.Dropped+uint64(st.Pending) < 19 {
			return fmt.Errorf("%d dropped and %d queued of the 19 behind the held message", st.Dropped, st.Pending)
		}
		return nil
	})
	if st := a.Stats(); st.Pending != 7 || st.Dropped != 12 {
		t.Errorf("Stats() = %d queued and %d dropped, want 7 queued (4 MiB of 512 KiB messages and their subjects) and 12 dropped", st.Pending, st.Dropped)
	}
	close(gate)
	acked := 0
	natstest.Eventually(t, 30*time.Second, func() error {
		for _, fut := range futs {
			select {
			case <-fut.Ok():
				acked++
			default:
			}
		}
		if acked < 8 {
			return fmt.Errorf("%d acknowledged", acked)
		}
		return nil
	})
	if st := a.Stats(); st.Dropped != 12 || acked != 8 {
		t.Errorf("Stats().Dropped = %d and %d acknowledged, want 12 dropped and 8 (the held one and 7 queued) acknowledged", st.Dropped, acked)
	}
	if ack, err := f.js.Publish(context.Background(), "incoming.dev-1.temp", []byte("after")); err != nil || ack.Stream != "OUTGOING" {
		t.Fatalf("Publish after the overflow = %+v, %v", ack, err)
	}
}

// The probes of kvmapper setup reach running owners and are dropped there: nothing stored.
func TestSetupProbesAreNotForwarded(t *testing.T) {
	eachReceive(t, func(t *testing.T, f *fixture) {
		p := f.pool("a", nil, nil)
		f.runAll(p, 1)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := setup.CheckDirect(ctx, f.js, setup.Config{Layout: f.lay, Mode: wire.ModeDirect, Receive: wire.Receive(f.receive)}); err != nil {
			t.Fatalf("CheckDirect beside running owners: %v", err)
		}
		// One probe went to each partition. A message published after them on the same
		// connection to each partition is forwarded after its partition's probe: once all are
		// acknowledged, every probe has been dealt with.
		byPart := map[int]string{}
		for i := 0; len(byPart) < partitions; i++ {
			if d := fmt.Sprintf("dev-%d", i); byPart[partOf(d)] == "" {
				byPart[partOf(d)] = d
				f.groups.set(d, "g")
			}
		}
		for _, d := range byPart {
			if ack, err := f.js.Publish(ctx, "incoming."+d+".temp", nil); err != nil || ack.Stream != "OUTGOING" {
				t.Fatalf("Publish(%s) = %+v, %v; want OUTGOING's PubAck", d, ack, err)
			}
		}
		if n := len(f.stream("UNMAPPED")); n != 0 {
			t.Errorf("UNMAPPED holds %d messages after the probes, want none", n)
		}
		if n := len(f.stream("OUTGOING")); n != partitions {
			t.Errorf("OUTGOING holds %d messages after the probes, want the %d published after them", n, partitions)
		}
		if st := p.Stats(); st.Mapped != partitions || len(st.Unmapped) != 0 {
			t.Errorf("Stats() = %+v after the probes and a message per partition, want %d mapped", st, partitions)
		}
	})
}

func TestNewRefusesBadConfig(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	nc := f.srv.Connect(t)
	for name, cfg := range map[string]direct.Config{
		"no layout":       {},
		"bad receive":     {Layout: f.lay, Receive: "some"},
		"bad prefix":      {Layout: f.lay, HandoffPrefix: "a.*"},
		"revision alone":  {Layout: f.lay, Revision: func() uint64 { return 0 }},
		"negative timout": {Layout: f.lay, HandoffTimeout: -time.Second},
	} {
		if _, err := direct.New(nc, f.groups.lookup, cfg); !errors.Is(err, direct.ErrInvalidConfig) {
			t.Errorf("New(%s) = %v, want ErrInvalidConfig", name, err)
		}
	}
	p, err := direct.New(nc, f.groups.lookup, direct.Config{Layout: f.lay})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Run(context.Background(), direct.Assignment{Partition: partitions}); !errors.Is(err, direct.ErrInvalidConfig) {
		t.Errorf("Run(partition %d) = %v, want ErrInvalidConfig", partitions, err)
	}
}
