package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// refuseSubject makes OUTGOING refuse every new message on subject, as the server refuses single
// messages under duress: it keeps one message per subject and discards new ones, and subject
// gets one now. release lets subject take messages again.
func (f *fixture) refuseSubject(subject string) (release func()) {
	f.t.Helper()
	ctx := context.Background()
	s, err := f.js.Stream(ctx, "OUTGOING")
	if err != nil {
		f.t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.Discard, cfg.DiscardNewPerSubject, cfg.MaxMsgsPerSubject = jetstream.DiscardNew, true, 1
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		f.t.Fatal(err)
	}
	if _, err := f.js.Publish(ctx, subject, []byte("placeholder"), jetstream.WithMsgID("placeholder "+subject)); err != nil {
		f.t.Fatal(err)
	}
	return func() {
		f.t.Helper()
		if err := s.Purge(ctx, jetstream.WithPurgeSubject(subject)); err != nil {
			f.t.Fatal(err)
		}
	}
}

// payloads returns the payloads of msgs, in order.
func payloads(msgs []jetstream.Msg) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = string(m.Data())
	}
	return out
}

// runLane runs one partition's lane of pool and returns what Run returned on a channel.
func runLane(t *testing.T, pool *lanes.Pool, a lanes.Assignment) (stop func(), res <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Go(func() { ch <- pool.Run(ctx, a) })
	stop = func() { cancel(); wg.Wait() }
	t.Cleanup(stop)
	return stop, ch
}

// The tests of reorder counting run the single-publish path (Config.Singles), which streams
// without batches still take: batches store nothing after a refused message (see
// TestRefusedMessageHoldsBackItsDevice), so a reorder cannot be made through them.

// A message refused while a later one of its device is stored, and resent by the next owner
// after the first was fenced, lands behind the later one. The next owner, which stored it,
// counts it: once, and the first owner not at all.
func TestReorderAcrossHandoverIsCountedOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-r"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	release := f.refuseSubject("outgoing.g." + dev + ".a")
	cfg := lanes.Config{Layout: f.lay, CheckpointInterval: 20 * time.Millisecond, RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond, Singles: true}
	first, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var lost atomic.Bool
	_, res := runLane(t, first, lanes.Assignment{Partition: p, Epoch: 1, Valid: func() bool { return !lost.Load() }})
	ctx := context.Background()
	for i, ev := range []string{"a", "b"} {
		if _, err := f.js.Publish(ctx, "incoming."+dev+"."+ev, []byte(fmt.Sprintf("%s:%d", dev, i))); err != nil {
			t.Fatal(err)
		}
	}
	// The second is stored (after the placeholder), the first refused, again and again.
	f.read("OUTGOING", 2)
	natstest.Eventually(t, 10*time.Second, func() error {
		if n := first.Stats().Failures; n < 3 {
			return fmt.Errorf("Stats().Failures = %d, want 3 rounds of refusals", n)
		}
		return nil
	})
	next := handOver(t, f, cfg, p, &lost, res, release, 2)
	// The test made a real reorder: dev-r:0 is stored after dev-r:1.
	if got := payloads(f.read("OUTGOING", 2)); strings.Join(got, " ") != "dev-r:1 dev-r:0" {
		t.Fatalf("OUTGOING holds %q, want dev-r:1 then dev-r:0 (the reorder this test is about)", got)
	}
	if got := first.Stats().Reorders; got != 0 {
		t.Errorf("first owner: Stats().Reorders = %d, want 0: it never stored the late message", got)
	}
	if got := next.Stats().Reorders; got != 1 {
		t.Errorf("next owner: Stats().Reorders = %d, want 1: it stored dev-r:0 after dev-r:1", got)
	}
}

// The same within one lane: refused for several rounds while the later message is stored, then
// stored behind it. One reorder, counted once, however many rounds it took.
func TestReorderWithinALaneIsCountedOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-r"
	f.groups.set(dev, "g")
	release := f.refuseSubject("outgoing.g." + dev + ".a")
	pool, _ := f.run(lanes.Config{RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond, Singles: true}, nil)
	ctx := context.Background()
	for i, ev := range []string{"a", "b"} {
		if _, err := f.js.Publish(ctx, "incoming."+dev+"."+ev, []byte(fmt.Sprintf("%s:%d", dev, i))); err != nil {
			t.Fatal(err)
		}
	}
	f.read("OUTGOING", 2)
	natstest.Eventually(t, 10*time.Second, func() error {
		if n := pool.Stats().Failures; n < 3 {
			return fmt.Errorf("Stats().Failures = %d, want 3 rounds of refusals", n)
		}
		return nil
	})
	release()
	natstest.Eventually(t, 10*time.Second, func() error {
		if st := pool.Stats(); st.Mapped != 2 {
			return fmt.Errorf("Stats() = %+v, want both messages mapped", st)
		}
		return nil
	})
	if got := payloads(f.read("OUTGOING", 2)); strings.Join(got, " ") != "dev-r:1 dev-r:0" {
		t.Fatalf("OUTGOING holds %q, want dev-r:1 then dev-r:0 (the reorder this test is about)", got)
	}
	if got := pool.Stats().Reorders; got != 1 {
		t.Errorf("Stats().Reorders = %d, want 1", got)
	}
}

// An acknowledgement that comes after its publish timed out is ignored, and the publish is
// resent; if the message had been stored (before a later one of its device), the resend is a
// duplicate and nothing is out of order: nothing may be counted.
//
// A relay stands between the lane and the stream: it stores each message in OUTGOING with the
// lane's headers, and hands the stream's acknowledgement back to the lane, except the first one
// for INCOMING:1, which it holds until the lane has timed that publish out.
func TestLateAcknowledgementIsNotAReorder(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-l"
	f.groups.set(dev, "g")
	ctx := context.Background()
	s, err := f.js.Stream(ctx, "OUTGOING")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.Subjects = []string{"stored.>"}
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	relay := f.srv.Connect(t)
	firstID := f.msgID(dev, 1)
	held := make(chan *nats.Msg, 1) // the late acknowledgement, addressed to the lane
	var once sync.Once
	if _, err := relay.Subscribe("outgoing.>", func(m *nats.Msg) {
		fwd := &nats.Msg{Subject: "stored." + strings.TrimPrefix(m.Subject, "outgoing."), Header: m.Header, Data: m.Data}
		ack, err := relay.RequestMsg(fwd, 5*time.Second)
		if err != nil {
			t.Errorf("relay: storing %s: %v", m.Subject, err)
			return
		}
		late := false
		if m.Header.Get("Nats-Msg-Id") == firstID {
			once.Do(func() { late = true })
		}
		if late {
			held <- &nats.Msg{Subject: m.Reply, Data: ack.Data}
			return
		}
		if err := relay.Publish(m.Reply, ack.Data); err != nil {
			t.Errorf("relay: %v", err)
		}
	}); err != nil {
		t.Fatal(err)
	}
	pool, _ := f.run(lanes.Config{PublishTimeout: 300 * time.Millisecond, RetryBackoff: 10 * time.Millisecond, Singles: true}, nil)
	for i, ev := range []string{"a", "b"} {
		if _, err := f.js.Publish(ctx, "incoming."+dev+"."+ev, []byte(fmt.Sprintf("%s:%d", dev, i))); err != nil {
			t.Fatal(err)
		}
	}
	var late *nats.Msg
	select {
	case late = <-held:
	case <-time.After(30 * time.Second):
		t.Fatalf("no acknowledgement of %s reached the relay within 30s", firstID)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		if n := pool.Stats().Failures; n == 0 {
			return errors.New("the publish whose acknowledgement is held has not timed out yet")
		}
		return nil
	})
	if err := relay.PublishMsg(late); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		if st := pool.Stats(); st.Mapped+st.Duplicates != 2 {
			return fmt.Errorf("Stats() = %+v, want both messages acknowledged", st)
		}
		return nil
	})
	if got := payloads(f.read("OUTGOING", 2)); strings.Join(got, " ") != "dev-l:0 dev-l:1" {
		t.Fatalf("OUTGOING holds %q, want dev-l:0 then dev-l:1", got)
	}
	// The held acknowledgement reaches the lane before or after the resend's: either way the
	// resend found INCOMING:1 stored where it was first.
	if st := pool.Stats(); st.Reorders != 0 {
		t.Errorf("Stats() = %+v, want no reorder", st)
	}
}

// A lane that stored a message behind a later one of its device, but was fenced before that
// message left its queue (an earlier one was still refused), counts it as it stops; the next
// owner counts what it stores out of order itself, and not the first owner's again.
func TestReorderStoredByAFencedLaneIsCounted(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-r"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	releaseC := f.refuseSubject("outgoing.g." + dev + ".c")
	releaseA := f.refuseSubject("outgoing.g." + dev + ".a")
	cfg := lanes.Config{Layout: f.lay, CheckpointInterval: 20 * time.Millisecond, RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond, Singles: true}
	first, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var lost atomic.Bool
	_, res := runLane(t, first, lanes.Assignment{Partition: p, Epoch: 1, Valid: func() bool { return !lost.Load() }})
	ctx := context.Background()
	for i, ev := range []string{"c", "a", "b"} {
		if _, err := f.js.Publish(ctx, "incoming."+dev+"."+ev, []byte(fmt.Sprintf("%s:%d", dev, i))); err != nil {
			t.Fatal(err)
		}
	}
	f.read("OUTGOING", 3) // two placeholders and dev-r:2
	releaseA()
	f.waitOrDump(first, "OUTGOING", 3, 10*time.Second) // the placeholder of c, dev-r:2, and now dev-r:1 behind it
	// Two more rounds of resending dev-r:0: the lane has read dev-r:1's acknowledgement.
	n := first.Stats().Failures
	natstest.Eventually(t, 10*time.Second, func() error {
		if got := first.Stats().Failures; got < n+2 {
			return fmt.Errorf("Stats().Failures = %d, want %d", got, n+2)
		}
		return nil
	})
	next := handOver(t, f, cfg, p, &lost, res, releaseC, 3)
	if got := payloads(f.read("OUTGOING", 3)); strings.Join(got, " ") != "dev-r:2 dev-r:1 dev-r:0" {
		t.Fatalf("OUTGOING holds %q, want dev-r:2, dev-r:1, dev-r:0: two messages stored after a later one", got)
	}
	if got := first.Stats().Reorders; got != 1 {
		t.Errorf("first owner: Stats().Reorders = %d, want 1 (dev-r:1, which it stored)", got)
	}
	if got := next.Stats().Reorders; got != 1 {
		t.Errorf("next owner: Stats().Reorders = %d, want 1 (dev-r:0, which it stored)", got)
	}
}

// handOver ends the first owner's lease by its clock (lost), waits for its Run (res) to end with
// ErrFenced, calls release (the refusals stop), and runs the next owner (epoch 2) until it has
// acknowledged want messages, new or duplicate.
func handOver(t *testing.T, f *fixture, cfg lanes.Config, p int, lost *atomic.Bool, res <-chan error, release func(), want uint64) *lanes.Pool {
	t.Helper()
	lost.Store(true)
	select {
	case err := <-res:
		if !errors.Is(err, lanes.ErrFenced) {
			t.Fatalf("Run(first owner) = %v, want ErrFenced", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first owner kept running after its lease clock ran out")
	}
	release()
	next, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runLane(t, next, lanes.Assignment{Partition: p, Epoch: 2})
	natstest.Eventually(t, 10*time.Second, func() error {
		if st := next.Stats(); st.Mapped+st.Duplicates != want {
			return fmt.Errorf("next owner: Stats() = %+v, want %d messages acknowledged", st, want)
		}
		return nil
	})
	return next
}

// With batches (the default on a stream that allows them), a message its stream refuses holds
// back every later message of its partition until it is stored: the same refusal that reorders
// single publishes (TestReorderWithinALaneIsCountedOnce) reorders nothing.
func TestRefusedMessageHoldsBackItsDevice(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-r"
	f.groups.set(dev, "g")
	release := f.refuseSubject("outgoing.g." + dev + ".a")
	pool, _ := f.run(lanes.Config{RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond}, nil)
	ctx := context.Background()
	for i, ev := range []string{"a", "b"} {
		if _, err := f.js.Publish(ctx, "incoming."+dev+"."+ev, []byte(fmt.Sprintf("%s:%d", dev, i))); err != nil {
			t.Fatal(err)
		}
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		if n := pool.Stats().Failures; n < 3 {
			return fmt.Errorf("Stats().Failures = %d, want 3 rounds of refusals", n)
		}
		return nil
	})
	if got := payloads(f.read("OUTGOING", 1)); strings.Join(got, " ") != "placeholder" {
		t.Fatalf("OUTGOING holds %q while dev-r:0 is refused, want only the placeholder: dev-r:1 must wait", got)
	}
	release()
	natstest.Eventually(t, 10*time.Second, func() error {
		if st := pool.Stats(); st.Mapped != 2 {
			return fmt.Errorf("Stats() = %+v, want both messages mapped", st)
		}
		return nil
	})
	if got := payloads(f.read("OUTGOING", 2)); strings.Join(got, " ") != "dev-r:0 dev-r:1" {
		t.Fatalf("OUTGOING holds %q, want dev-r:0 then dev-r:1", got)
	}
	if got := pool.WriteModes()["OUTGOING"]; got != "batch" {
		t.Errorf("WriteModes()[OUTGOING] = %q, want batch", got)
	}
}
