package ordered_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/ordered"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// env is a server with OUTGOING and UNMAPPED as the writer's tests want them.
type env struct {
	t   *testing.T
	srv *natstest.Server
	nc  *nats.Conn
	js  jetstream.JetStream
}

func newEnv(t *testing.T, out func(*jetstream.StreamConfig), opts ...nats.Option) *env {
	t.Helper()
	srv := natstest.Start(t)
	nc, js := srv.JetStream(t, opts...)
	e := &env{t: t, srv: srv, nc: nc, js: js}
	cfg := jetstream.StreamConfig{Name: "OUTGOING", Subjects: []string{"outgoing.>"}, Duplicates: 2 * time.Minute,
		AllowBatchPublish: true, AllowAtomicPublish: true}
	if out != nil {
		out(&cfg)
	}
	e.create(cfg)
	e.create(jetstream.StreamConfig{Name: "UNMAPPED", Subjects: []string{"unmapped.>"}, AllowBatchPublish: true, AllowAtomicPublish: true})
	return e
}

func (e *env) create(cfg jetstream.StreamConfig) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := e.js.CreateStream(ctx, cfg); err != nil {
		e.t.Fatalf("CreateStream(%s): %v", cfg.Name, err)
	}
}

// ids returns the Nats-Msg-Id of every message stream holds, in order.
func (e *env) ids(stream string) []string {
	e.t.Helper()
	return idsOfStream(e.t, e.js, stream)
}

// msgs makes n messages for OUTGOING, keys from..., ids "m-<key>", spread over 3 subjects.
func msgs(from, n int) []*ordered.Msg {
	out := make([]*ordered.Msg, n)
	for i := range out {
		k := from + i
		out[i] = &ordered.Msg{Key: uint64(k), Stream: 0, Out: &nats.Msg{
			Subject: "outgoing.g.d" + strconv.Itoa(k%3) + ".e",
			Header:  nats.Header{nats.MsgIdHdr: []string{"m-" + strconv.Itoa(k)}},
			Data:    []byte("payload " + strconv.Itoa(k)),
		}}
	}
	return out
}

func idsOf(ms []*ordered.Msg) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Out.Header.Get(nats.MsgIdHdr))
	}
	return out
}

// driver plays a lane: it sends msgs in bursts, flushing after each, handles the answers, and
// recovers after failures, until every message is popped.
type driver struct {
	t      *testing.T
	in     *ordered.Inbox
	w      *ordered.Writer
	hooks  ordered.Hooks
	popped []*ordered.Msg
	// between, when set, runs after each burst and each wait, told how many bursts were sent
	// (the fault of a test).
	between func(bursts int)
	// paced sends each burst once the one before is stored: one batch at a time.
	paced bool
}

func newDriver(t *testing.T, nc *nats.Conn, streams []ordered.Stream, cfg ordered.Config) *driver {
	t.Helper()
	in, err := ordered.NewInbox(nc, 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(in.Close)
	if cfg.RetryBackoff == 0 {
		cfg.RetryBackoff = 5 * time.Millisecond
	}
	return &driver{t: t, in: in, w: in.NewWriter(streams, cfg)}
}

func (d *driver) pop() {
	for m := d.w.Pop(); m != nil; m = d.w.Pop() {
		d.popped = append(d.popped, m)
	}
}

// run sends ms in bursts of burst and returns once all are popped, or fails the test after 30s.
func (d *driver) run(ms []*ordered.Msg, burst int) error {
	d.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	want := len(d.popped) + len(ms)
	for i, b := 0, 0; len(d.popped) < want; {
		if ctx.Err() != nil {
			d.t.Fatalf("messages not all popped within 30s: %d of %d; %s", len(d.popped), want, d.w)
		}
		d.in.Drain(-1)
		d.pop()
		if err := d.w.Fenced(); err != nil {
			return err
		}
		if d.w.Failed() {
			if err := d.w.Recover(ctx, d.hooks); err != nil {
				return err
			}
			continue
		}
		if i < len(ms) && (!d.paced || d.w.Len() == 0) {
			for n := 0; n < burst && i < len(ms); n++ {
				d.w.Send(ms[i])
				i++
			}
			d.w.Flush()
			if d.between != nil {
				d.between(b)
			}
			b++
			continue
		}
		if d.between != nil {
			d.between(b)
		}
		if err := d.w.Wait(ctx); err != nil {
			d.t.Fatalf("messages not all popped within 30s: %d of %d; %s", len(d.popped), want, d.w)
		}
	}
	return nil
}

// TestWritesInOrder: every mode stores every message once, in the order given, and pops them in
// that order, stored.
func TestWritesInOrder(t *testing.T) {
	for _, mode := range []ordered.Mode{ordered.ModeSingle, ordered.ModeBatch, ordered.ModeAtomic} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, nil)
			d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: mode}}, ordered.Config{})
			ms := msgs(1, 3000)
			if err := d.run(ms, 37); err != nil {
				t.Fatal(err)
			}
			if got, want := idsOf(d.popped), idsOf(ms); !slices.Equal(got, want) {
				t.Fatalf("popped %d messages out of order", len(got))
			}
			for _, m := range d.popped {
				if !m.Stored || m.Duplicate || m.Dropped {
					t.Fatalf("popped %+v, want stored as new", m)
				}
			}
			if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
				t.Fatalf("OUTGOING holds %d messages, want the %d sent, once each, in order", len(got), len(ms))
			}
		})
	}
}

// TestProbeCountsDuplicates: after Probe, a batch-mode writer sends one message at a time until
// one is stored as new, so the duplicates of what a previous writer stored are known exactly; then
// it batches.
func TestProbeCountsDuplicates(t *testing.T) {
	for _, mode := range []ordered.Mode{ordered.ModeBatch, ordered.ModeAtomic} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, nil)
			prev := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeSingle}}, ordered.Config{})
			if err := prev.run(msgs(1, 7), 7); err != nil {
				t.Fatal(err)
			}
			d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: mode}}, ordered.Config{})
			d.w.Probe()
			ms := msgs(1, 100)
			if err := d.run(ms, 50); err != nil {
				t.Fatal(err)
			}
			dups := 0
			for i, m := range d.popped {
				if m.Duplicate {
					dups++
					if i >= 7 {
						t.Errorf("message %d popped as a duplicate, want new", m.Key)
					}
				} else if i < 7 {
					t.Errorf("message %d popped as new, want a duplicate (stored before)", m.Key)
				}
			}
			if dups != 7 {
				t.Errorf("%d duplicates, want 7", dups)
			}
			if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
				t.Fatalf("OUTGOING holds %v, want %v", got, idsOf(ms))
			}
		})
	}
}

// TestWaitingMessagesGoWhenTheBatchAnswers: what is given while a batch commits waits behind it;
// once the sender flushed, it is committed as soon as that batch's answer comes, with no further
// Flush from the sender (whose next one may be a tick away when nothing new arrives).
func TestWaitingMessagesGoWhenTheBatchAnswers(t *testing.T) {
	for _, mode := range []ordered.Mode{ordered.ModeBatch, ordered.ModeAtomic} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, nil)
			d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: mode}}, ordered.Config{})
			ms := msgs(1, 6)
			for _, m := range ms[:3] {
				d.w.Send(m)
			}
			d.w.Flush() // the first batch commits
			for _, m := range ms[3:] {
				d.w.Send(m) // wait behind it
			}
			d.w.Flush()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for len(d.popped) < len(ms) {
				// Only answers and expiry: no Send, no Flush.
				if err := d.w.Wait(ctx); err != nil {
					t.Fatalf("%d of %d stored: %v; %s", len(d.popped), len(ms), err, d.w)
				}
				if d.w.Failed() {
					t.Fatalf("the writer failed (%v) with %d of %d stored; %s", d.w.FirstErr(), len(d.popped), len(ms), d.w)
				}
				d.pop()
			}
			if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
				t.Fatalf("OUTGOING holds %v, want %v", got, idsOf(ms))
			}
		})
	}
}

// TestLostMessageIsResentInOrder: a batch message lost on the way (the server never sees it) ends
// the batch at the hole (a fast batch) or the whole batch (an atomic one); nothing after it is
// stored, and the round of resends stores the rest in order. (Single publishes cannot promise
// that: the stream stores what follows a lost message before the writer knows it was lost.)
func TestLostMessageIsResentInOrder(t *testing.T) {
	for _, mode := range []ordered.Mode{ordered.ModeBatch, ordered.ModeAtomic} {
		t.Run(mode.String(), func(t *testing.T) {
			drop := &natstest.Dropper{}
			e := newEnv(t, nil, nats.SetCustomDialer(drop))
			d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: mode}}, ordered.Config{PublishTimeout: time.Second, StallTimeout: 500 * time.Millisecond})
			last := -1
			d.between = func(b int) {
				if b%5 == 0 && b > last { // once after every fifth burst
					last = b
					drop.DropNext("outgoing.", 1)
				}
			}
			ms := msgs(1, 600)
			if err := d.run(ms, 20); err != nil {
				t.Fatal(err)
			}
			if drop.Dropped() == 0 {
				t.Fatal("nothing was dropped: the test proves nothing")
			}
			if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
				t.Fatalf("OUTGOING holds %d messages (%d dropped on the way), want the %d sent once each in order", len(got), drop.Dropped(), len(ms))
			}
		})
	}
}

// TestRefusedMessageIsRedirected: a message its stream refuses for good (a per-message TTL on a
// stream that does not allow them) goes where Redirect sends it; the messages after it in the
// batch are stored after it, in order.
func TestRefusedMessageIsRedirected(t *testing.T) {
	for _, mode := range []ordered.Mode{ordered.ModeSingle, ordered.ModeBatch, ordered.ModeAtomic} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, nil)
			d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: mode}, {Name: "UNMAPPED", Mode: mode}}, ordered.Config{})
			var refused []error
			d.hooks.Redirect = func(m *ordered.Msg) bool {
				refused = append(refused, m.Err)
				m.Stream = 1
				m.Out = &nats.Msg{Subject: "unmapped.d.e", Header: nats.Header{nats.MsgIdHdr: m.Out.Header[nats.MsgIdHdr]}}
				return true
			}
			ms := msgs(1, 30)
			ms[11].Out.Header.Set("Nats-TTL", "1m")
			if err := d.run(ms, 30); err != nil {
				t.Fatal(err)
			}
			var apiErr *jetstream.APIError
			if len(refused) != 1 || !errors.As(refused[0], &apiErr) || apiErr.Code != 400 {
				t.Fatalf("Redirect saw %v, want one 400 refusal", refused)
			}
			want := append(idsOf(ms[:11]), idsOf(ms[12:])...)
			if got := e.ids("OUTGOING"); !slices.Equal(got, want) {
				t.Fatalf("OUTGOING holds %v, want %v", got, want)
			}
			if got := e.ids("UNMAPPED"); !slices.Equal(got, []string{"m-12"}) {
				t.Fatalf("UNMAPPED holds %v, want m-12", got)
			}
		})
	}
}

// TestFallsBackToSingles: a stream that does not allow batches, given as a batch stream, is
// written singly from its first refusal on, with one call of OnFallback, and nothing is lost.
func TestFallsBackToSingles(t *testing.T) {
	for _, mode := range []ordered.Mode{ordered.ModeBatch, ordered.ModeAtomic} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, func(c *jetstream.StreamConfig) { c.AllowBatchPublish, c.AllowAtomicPublish = false, false })
			var fell []string
			d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: mode}}, ordered.Config{
				OnFallback: func(stream string, err error) { fell = append(fell, fmt.Sprintf("%s: %v", stream, err)) }})
			ms := msgs(1, 200)
			if err := d.run(ms, 25); err != nil {
				t.Fatal(err)
			}
			if len(fell) != 1 || d.w.Mode(0) != ordered.ModeSingle {
				t.Fatalf("OnFallback called %v, mode %s; want once, then single", fell, d.w.Mode(0))
			}
			if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
				t.Fatalf("OUTGOING holds %d messages, want the %d sent in order", len(got), len(ms))
			}
		})
	}
}

// TestFencedWriterStoresNothingAfterItsSuccessor: a writer whose atomic batches carry a fence
// (the last record on the partition's fence subject is the one its owner wrote) stops with
// ErrFenced at the first batch that reaches the stream after a successor wrote its own record,
// from another connection, while the writer was sending: nothing of the writer is stored after
// the successor's record, and what it popped as stored is exactly what the stream holds of it.
func TestFencedWriterStoresNothingAfterItsSuccessor(t *testing.T) {
	const fence = "kvmapper.fence.OUTGOING.3"
	e := newEnv(t, func(c *jetstream.StreamConfig) { c.Subjects = append(c.Subjects, "kvmapper.fence.>") })
	ctx := context.Background()
	own, err := e.js.Publish(ctx, fence, []byte(`{"epoch":1}`), jetstream.WithExpectLastSequencePerSubject(0))
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeAtomic}}, ordered.Config{})
	d.w.SetFence(0, fence, own.Sequence)
	d.paced = true
	other := e.srv.Connect(t)
	ojs, err := jetstream.New(other)
	if err != nil {
		t.Fatal(err)
	}
	var successor uint64
	d.between = func(int) {
		// Once the writer has stored some: its next batches are in flight or waiting.
		if successor == 0 && len(d.popped) >= 100 {
			ack, err := ojs.Publish(ctx, fence, []byte(`{"epoch":2}`), jetstream.WithExpectLastSequencePerSubject(own.Sequence))
			if err != nil {
				t.Errorf("the successor's fence record: %v", err)
				return
			}
			successor = ack.Sequence
		}
	}
	ms := msgs(1, 400)
	err = d.run(ms, 20)
	if !errors.Is(err, ordered.ErrFenced) {
		t.Fatalf("run = %v, want ErrFenced", err)
	}
	if successor == 0 {
		t.Fatal("the successor wrote no record")
	}
	s, err := e.js.Stream(ctx, "OUTGOING")
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var before []string
	for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if m.Subject == fence {
			continue
		}
		if seq > successor {
			t.Errorf("the fenced writer stored %s at %d, after its successor's record at %d", m.Header.Get(nats.MsgIdHdr), seq, successor)
		}
		before = append(before, m.Header.Get(nats.MsgIdHdr))
	}
	if len(before) == 0 || len(before) >= len(ms) {
		t.Fatalf("the writer stored %d of %d before the fence: the fence struck at no moment that matters", len(before), len(ms))
	}
	if got := idsOf(d.popped); !slices.Equal(got, before) {
		t.Fatalf("popped as stored %d messages, the stream holds %d of the writer", len(got), len(before))
	}
	if !slices.Equal(before, idsOf(ms[:len(before)])) {
		t.Fatalf("the stream holds %v, want a prefix of what was sent", before)
	}
}

// TestReconnectSendsNothingBeforeWhatTheOldConnectionLost: single publishes lost with a
// connection (sent, never answered) are sent again, in order, before the first message given
// after the reconnect: that one must not be stored ahead of them. Twice, so that the writer's
// memory of the connection it last looked at is tried across a second reconnect.
func TestReconnectSendsNothingBeforeWhatTheOldConnectionLost(t *testing.T) {
	drop := &natstest.Dropper{}
	e := newEnv(t, nil, nats.SetCustomDialer(drop), nats.ReconnectWait(10*time.Millisecond))
	d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeSingle}}, ordered.Config{PublishTimeout: 2 * time.Second})
	var all []*ordered.Msg
	for round := 1; round <= 2; round++ {
		// Burst 0 goes through; burst 1 goes out and the server sees none of it; the connection
		// dies with burst 1 in flight; burst 2 is the first given on the new connection.
		step, lost := 0, drop.Dropped()
		d.between = func(int) {
			switch step {
			case 0:
				if err := e.nc.Flush(); err != nil { // burst 0 is written out
					t.Fatalf("Flush: %v", err)
				}
				drop.Drop("outgoing.")
			case 1:
				if err := e.nc.Flush(); err != nil { // burst 1 is written out
					t.Fatalf("Flush: %v", err)
				}
				if n := drop.Dropped() - lost; n != 5 {
					t.Fatalf("round %d: %d publishes lost before the reconnect, want burst 1's 5", round, n)
				}
				if err := e.nc.ForceReconnect(); err != nil {
					t.Fatalf("ForceReconnect: %v", err)
				}
				natstest.Eventually(t, 10*time.Second, func() error {
					if e.nc.Stats().Reconnects < uint64(round) || !e.nc.IsConnected() {
						return fmt.Errorf("round %d: not reconnected", round)
					}
					return nil
				})
				drop.Drop("")
			}
			step++
		}
		ms := msgs(len(all)+1, 25)
		all = append(all, ms...)
		if err := d.run(ms, 5); err != nil {
			t.Fatal(err)
		}
		if step < 2 {
			t.Fatalf("round %d: the connection was never replaced: the test proves nothing", round)
		}
	}
	if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(all)) {
		t.Fatalf("OUTGOING holds %v, want the %d sent, once each, in order", got, len(all))
	}
}

// TestReconnectBetweenCheckAndPublishSendsNothingAhead: the reconnect completes after Send has
// looked at the connection and before the first message given after it is published (the window
// between the writer's check of the connection and its publish, made wide by a hook). That
// message must not go out on the new connection ahead of the five the old one lost: it is held
// back and sent after their resend, in order.
func TestReconnectBetweenCheckAndPublishSendsNothingAhead(t *testing.T) {
	drop := &natstest.Dropper{}
	e := newEnv(t, nil, nats.SetCustomDialer(drop), nats.ReconnectWait(10*time.Millisecond))
	d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeSingle}}, ordered.Config{PublishTimeout: 2 * time.Second})
	armed, struck := false, false
	defer ordered.SetBeforePublish(func() {
		if !armed {
			return
		}
		armed, struck = false, true
		if err := e.nc.ForceReconnect(); err != nil {
			t.Fatalf("ForceReconnect: %v", err)
		}
		natstest.Eventually(t, 10*time.Second, func() error {
			if e.nc.Stats().Reconnects < 1 || !e.nc.IsConnected() {
				return fmt.Errorf("not reconnected")
			}
			return nil
		})
		drop.Drop("")
	})()
	// Burst 0 goes through; burst 1 goes out and the server sees none of it; the first publish
	// of burst 2 finds the connection replaced under it.
	step := 0
	d.between = func(int) {
		switch step {
		case 0:
			if err := e.nc.Flush(); err != nil { // burst 0 is written out
				t.Fatalf("Flush: %v", err)
			}
			drop.Drop("outgoing.")
		case 1:
			if err := e.nc.Flush(); err != nil { // burst 1 is written out
				t.Fatalf("Flush: %v", err)
			}
			if n := drop.Dropped(); n != 5 {
				t.Fatalf("%d publishes lost before the reconnect, want burst 1's 5", n)
			}
			armed = true
		}
		step++
	}
	ms := msgs(1, 25)
	if err := d.run(ms, 5); err != nil {
		t.Fatal(err)
	}
	if !struck {
		t.Fatalf("no publish found the connection replaced under it: the test proves nothing")
	}
	if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
		t.Fatalf("OUTGOING holds %v, want the %d sent, once each, in order", got, len(ms))
	}
}

// TestDroppedWriterFreesItsAtomicSlot: a writer dropped (its lane stopped, the drain timed out)
// while its atomic batch is unanswered gives the batch's slot back. The slots bound the open
// batches of a stream for every writer of a process: one kept by a writer that is gone would
// never come back, and once all were gone no writer of the process would send to that stream
// again.
func TestDroppedWriterFreesItsAtomicSlot(t *testing.T) {
	drop := &natstest.Dropper{}
	e := newEnv(t, nil)
	slots := ordered.NewSlots(1)
	streams := []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeAtomic, Slots: slots}}
	nc, _ := e.srv.JetStream(t, nats.SetCustomDialer(drop))
	gone := newDriver(t, nc, streams, ordered.Config{PublishTimeout: 2 * time.Second})
	drop.Drop("outgoing.")
	for _, m := range msgs(1, 5) {
		gone.w.Send(m)
	}
	gone.w.Flush()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if drop.Dropped() == 0 {
		t.Fatal("the dropped writer's batch was never sent: it holds no slot, the test proves nothing")
	}
	gone.w.Drop()
	gone.w.Close()
	d := newDriver(t, e.nc, streams, ordered.Config{PublishTimeout: 2 * time.Second})
	ms := msgs(6, 20)
	if err := d.run(ms, 5); err != nil {
		t.Fatal(err)
	}
	if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
		t.Fatalf("OUTGOING holds %v, want the second writer's %d, in order", got, len(ms))
	}
}

// gatedDialer dials through a Dropper, but holds every dial while its gate is shut: a
// connection lost meanwhile stays reconnecting until the gate opens.
type gatedDialer struct {
	*natstest.Dropper
	mu   sync.Mutex
	gate chan struct{}
}

func (g *gatedDialer) Dial(network, address string) (net.Conn, error) {
	g.mu.Lock()
	gate := g.gate
	g.mu.Unlock()
	if gate != nil {
		<-gate
	}
	return g.Dropper.Dial(network, address)
}

func (g *gatedDialer) shut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.gate = make(chan struct{})
}

func (g *gatedDialer) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.gate != nil {
		close(g.gate)
		g.gate = nil
	}
}

// TestNothingIsSentWhileReconnecting: a connection that buffers publishes while it reconnects
// (nats.go's default) sends what it buffered first on the new connection. The first message
// given after the old connection lost five is published while the connection reconnects: it
// must not be buffered ahead of their resend.
func TestNothingIsSentWhileReconnecting(t *testing.T) {
	g := &gatedDialer{Dropper: &natstest.Dropper{}}
	e := newEnv(t, nil, nats.SetCustomDialer(g), nats.ReconnectWait(10*time.Millisecond))
	d := newDriver(t, e.nc, []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeSingle}}, ordered.Config{PublishTimeout: 2 * time.Second})
	armed, struck := false, false
	defer ordered.SetBeforePublish(func() {
		if !armed {
			return
		}
		armed, struck = false, true
		g.Drop("")
		g.shut()
		if err := e.nc.ForceReconnect(); err != nil {
			t.Fatalf("ForceReconnect: %v", err)
		}
		natstest.Eventually(t, 10*time.Second, func() error {
			if s := e.nc.Status(); s != nats.RECONNECTING {
				return fmt.Errorf("connection %v, want reconnecting", s)
			}
			return nil
		})
	})()
	// Burst 0 goes through; burst 1 goes out and the server sees none of it; burst 2 is given
	// while the connection reconnects, and the connection comes back once it has been.
	step := 0
	d.between = func(int) {
		switch step {
		case 0:
			if err := e.nc.Flush(); err != nil {
				t.Fatalf("Flush: %v", err)
			}
			g.Drop("outgoing.")
		case 1:
			if err := e.nc.Flush(); err != nil {
				t.Fatalf("Flush: %v", err)
			}
			if n := g.Dropped(); n != 5 {
				t.Fatalf("%d publishes lost before the reconnect, want burst 1's 5", n)
			}
			armed = true
		case 2:
			g.open()
		}
		step++
	}
	ms := msgs(1, 25)
	if err := d.run(ms, 5); err != nil {
		t.Fatal(err)
	}
	if !struck {
		t.Fatalf("no publish was made while the connection reconnected: the test proves nothing")
	}
	if got := e.ids("OUTGOING"); !slices.Equal(got, idsOf(ms)) {
		t.Fatalf("OUTGOING holds %v, want the %d sent, once each, in order", got, len(ms))
	}
}

// TestAtomicBatchIDsOfTwoInboxes: the writers of two inboxes on one connection (as a replica's
// lanes and its parking share one) number their writers and batches alike, and their short
// batch ids (8 characters of the inbox's nuid, not all 22: the server stores the id with every
// message) still differ, so that the stream never takes two writers' batches for one. The ids
// are read off the wire, as the server sees them.
func TestAtomicBatchIDsOfTwoInboxes(t *testing.T) {
	e := newEnv(t, nil)
	var mu sync.Mutex
	ids := map[string]bool{}
	tap := e.srv.Connect(t)
	sub, err := tap.Subscribe("outgoing.>", func(m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		ids[m.Header.Get("Nats-Batch-Id")] = true
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tap.Flush(); err != nil {
		t.Fatal(err)
	}
	streams := []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeAtomic}}
	a := newDriver(t, e.nc, streams, ordered.Config{})
	b := newDriver(t, e.nc, streams, ordered.Config{})
	a.paced, b.paced = true, true // one batch each at a time: batch numbers 1, 2, … alike
	if err := a.run(msgs(1, 40), 10); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	first := maps.Clone(ids)
	clear(ids)
	mu.Unlock()
	if err := b.run(msgs(41, 40), 10); err != nil {
		t.Fatal(err)
	}
	if err := sub.Drain(); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 5*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(first) != 4 || len(ids) != 4 {
			return fmt.Errorf("batch ids seen: %v and %v, want 4 each", first, ids)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	for id := range ids {
		if first[id] {
			t.Errorf("batch id %q used by the writers of both inboxes", id)
		}
		if len(id) > len("12345678w1b4") {
			t.Errorf("batch id %q: want 8 characters of the inbox, the writer and the batch", id)
		}
	}
	if got := e.ids("OUTGOING"); len(got) != 80 {
		t.Errorf("OUTGOING holds %d messages, want 80", len(got))
	}
}
