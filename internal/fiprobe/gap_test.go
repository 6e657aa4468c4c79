package fiprobe_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// TestLostMessageIsAGap: a message lost on the way (here: dropped by the client's connection
// before the server sees it) shows when the next one arrives: the server answers
// {"type":"gap","last_seq":<expected>,"seq":<arrived>}. With gap: fail it ends the batch there
// (the PubAck counts the messages before the hole; nothing after it is stored); with gap: ok
// it stores the rest. A ping after the last message finds a hole at the end the same way.
func TestLostMessageIsAGap(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		gapOK bool
		last  bool // the lost message is the last one, found by a ping
	}{
		{name: "fail"}, {name: "ok", gapOK: true}, {name: "ping", last: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &natstest.Dropper{}
			s := natstest.Start(t)
			nc := s.Connect(t, nats.SetCustomDialer(d))
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			createOutgoing(t, js, 1, nil)
			b := newBatch(t, nc, 500, tc.gapOK)
			lost, n := 5, 8
			if tc.last {
				lost = n
			}
			for i := 1; i <= n; i++ {
				subject := "outgoing.g.dev.t"
				if i == lost {
					subject = "outgoing.lost.dev.t"
					d.Drop("outgoing.lost.")
				}
				b.add(msg(subject, "g-"+strconv.Itoa(i)))
				if i == lost {
					if err := nc.Flush(); err != nil {
						t.Fatal(err)
					}
					d.Drop("")
				}
			}
			if tc.last {
				b.ping("outgoing.g.dev.t")
			} else {
				b.end("outgoing.g.dev.t")
			}
			got, ack := b.all(wait)
			var gap *answer
			for i, a := range got {
				if a.Type == "gap" {
					gap = &got[i]
				}
			}
			if gap == nil || gap.LastSeq != uint64(lost) || gap.Seq != uint64(lost+1) {
				t.Fatalf("answers %v, want a gap with last_seq %d, seq %d", got, lost, lost+1)
			}
			ids := stored(t, js, "OUTGOING")
			switch {
			case tc.gapOK:
				if ack.Count != uint64(n) {
					t.Fatalf("PubAck %s, want count %d", ack, n)
				}
				sameIDs(t, "OUTGOING", ids, append(ids0("g-", 1, lost-1), ids0("g-", lost+1, n)...))
			default:
				if ack.Count != uint64(lost-1) {
					t.Fatalf("PubAck %s, want count %d", ack, lost-1)
				}
				sameIDs(t, "OUTGOING", ids, ids0("g-", 1, lost-1))
			}
		})
	}
}

func ids0(prefix string, from, to int) []string {
	if to < from {
		return nil
	}
	return ids(prefix, from, to)
}

// TestReconnectKeepsTheBatch: a batch belongs to the stream, not to the connection: after a
// reconnect the client goes on with the next sequence (its inbox is subscribed again) and the
// batch completes, as long as nothing was lost meanwhile.
func TestReconnectKeepsTheBatch(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	reconnected := make(chan struct{}, 1)
	nc := s.Connect(t, nats.ReconnectBufSize(-1), nats.ReconnectWait(10*time.Millisecond),
		nats.ReconnectHandler(func(*nats.Conn) { reconnected <- struct{}{} }))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	createOutgoing(t, js, 1, nil)
	b := newBatch(t, nc, 2, false)
	for i := 1; i <= 5; i++ {
		b.add(msg("outgoing.g.dev.t", "c-"+strconv.Itoa(i)))
	}
	// Up to message 4 acknowledged: the server has them all before the connection goes.
	for a := b.next(wait); a.Seq < 4; a = b.next(wait) {
	}
	if err := nc.ForceReconnect(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-reconnected:
	case <-time.After(wait):
		t.Fatal("no reconnect")
	}
	for i := 6; i <= 10; i++ {
		b.add(msg("outgoing.g.dev.t", "c-"+strconv.Itoa(i)))
	}
	b.end("outgoing.g.dev.t")
	if _, ack := b.all(wait); ack.Count != 10 || ack.Error != nil {
		t.Fatalf("PubAck %s, want count 10", ack)
	}
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), ids("c-", 1, 10))
}

// TestAbandonedBatchIsForgotten: a batch nobody ends is forgotten after the server's batch
// timeout (jetstream { limits { max_batch_timeout } }, default 10s, reset by every message),
// silently: its messages stay stored, no PubAck and no advisory is sent, and its next message
// or ping is refused as an unknown batch. A ping, like a message, restarts the timeout, and its
// answer repeats the last flow acknowledgement rather than saying what is stored.
func TestAbandonedBatchIsForgotten(t *testing.T) {
	t.Parallel()
	const timeout = time.Second
	_, nc, js := outgoing(t, nil, func(o *server.Options) { o.JetStreamLimits.MaxBatchTimeout = timeout })
	adv, err := nc.SubscribeSync("$JS.EVENT.ADVISORY.>")
	if err != nil {
		t.Fatal(err)
	}
	b := newBatch(t, nc, 500, false)
	for i := 1; i <= 3; i++ {
		b.add(msg("outgoing.g.dev.t", "a-"+strconv.Itoa(i)))
	}
	if a := b.next(wait); a.Type != "ack" || a.Seq != 0 {
		t.Fatalf("first answer %s, want the first flow acknowledgement", a)
	}
	// Every message, pings included, restarts the timeout: poll by pinging after ever longer
	// silences, each past the timeout, until the batch is gone.
	quiet := timeout + timeout/4
	for deadline := time.Now().Add(20 * timeout); ; quiet += timeout / 4 {
		if time.Now().After(deadline) {
			t.Fatalf("the batch still lives %v after its last message", 20*timeout)
		}
		<-time.After(quiet)
		b.ping("outgoing.g.dev.t")
		a := b.next(wait)
		if a.Error != nil && a.Error.ErrorCode == 10208 {
			t.Logf("forgotten within %v of silence (timeout %v)", quiet, timeout)
			break
		}
		if a.Type != "ack" {
			t.Fatalf("ping: %s, want a flow acknowledgement or 10208", a)
		}
	}
	t.Run("pings keep it", func(t *testing.T) {
		b := newBatch(t, nc, 500, false)
		b.add(msg("outgoing.g.dev.t", "a-4"))
		if a := b.next(wait); a.Type != "ack" {
			t.Fatalf("first answer %s, want the first flow acknowledgement", a)
		}
		start := time.Now()
		for time.Since(start) < 3*timeout {
			<-time.After(timeout / 2)
			b.ping("outgoing.g.dev.t")
			// The answer repeats the last flow acknowledgement (seq 0), not what is stored
			// (message 1): only ending the batch confirms a partial interval.
			if a := b.next(wait); a.Type != "ack" || a.Seq != 0 {
				t.Fatalf("ping %v after the last message: %s, want the flow acknowledgement of seq 0", time.Since(start).Round(time.Millisecond), a)
			}
		}
		b.end("outgoing.g.dev.t")
		if _, ack := b.all(wait); ack.Count != 1 {
			t.Fatalf("PubAck %s, want count 1", ack)
		}
	})
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), ids("a-", 1, 4))
	for {
		m, err := adv.NextMsg(100 * time.Millisecond)
		if err != nil {
			break
		}
		if contains(m.Subject, "BATCH") {
			t.Fatalf("advisory about the batch: %s", m.Subject)
		}
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// TestInflightBatchLimit: a stream takes at most max_batch_inflight_per_stream open batches
// (default 1000; a server at most max_batch_inflight_total, default 50,000, across streams and
// accounts); a batch beyond it is refused on its first message with 429/10211, and the others
// go on.
func TestInflightBatchLimit(t *testing.T) {
	t.Parallel()
	_, nc, js := outgoing(t, nil, func(o *server.Options) { o.JetStreamLimits.MaxBatchInflightPerStream = 2 })
	var bs []*batch
	for i := range 3 {
		b := newBatch(t, nc, 500, false)
		b.add(msg("outgoing.g.dev.t", "l-"+strconv.Itoa(i)))
		bs = append(bs, b)
	}
	for i, b := range bs[:2] {
		if a := b.next(wait); a.Type != "ack" {
			t.Fatalf("batch %d: %s, want a flow acknowledgement", i, a)
		}
	}
	if a := bs[2].next(wait); a.Error == nil || a.Error.ErrorCode != 10211 || a.Error.Code != 429 {
		t.Fatalf("third batch: %s, want error 429/10211 (too many inflight)", a)
	}
	for _, b := range bs[:2] {
		b.end("outgoing.g.dev.t")
		if _, ack := b.all(wait); ack.Count != 1 {
			t.Fatalf("PubAck %s, want count 1", ack)
		}
	}
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), []string{"l-0", "l-1"})
}

// TestBatchSizeIsUnbounded: max_batch_size (default 1000) bounds atomic batches only; a fast
// batch takes any number of messages.
func TestBatchSizeIsUnbounded(t *testing.T) {
	t.Parallel()
	_, nc, js := outgoing(t, nil, func(o *server.Options) { o.JetStreamLimits.MaxBatchSize = 10 })
	b := newBatch(t, nc, 500, false)
	const n = 100
	for i := 1; i <= n; i++ {
		b.add(msg("outgoing.g.dev.t", "s-"+strconv.Itoa(i)))
	}
	b.end("outgoing.g.dev.t")
	if _, ack := b.all(wait); ack.Count != n || ack.Error != nil {
		t.Fatalf("PubAck %s, want count %d", ack, n)
	}
	if got := len(stored(t, js, "OUTGOING")); got != n {
		t.Fatalf("OUTGOING holds %d, want %d", got, n)
	}
}

// TestServerRestartForgetsTheBatch: open batches live in the server's memory. After a restart
// of a single server the stored messages are there, the batch is not: its next message is refused
// as an unknown batch (10208), and a client that lost answers cannot learn from the server what
// of it was stored, beyond reading the stream.
func TestServerRestartForgetsTheBatch(t *testing.T) {
	t.Parallel()
	s, _, _ := outgoing(t, nil)
	reconnected := make(chan struct{}, 1)
	nc := s.Connect(t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond),
		nats.ReconnectHandler(func(*nats.Conn) { reconnected <- struct{}{} }))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	b := newBatch(t, nc, 2, false)
	for i := 1; i <= 4; i++ {
		b.add(msg("outgoing.g.dev.t", "v-"+strconv.Itoa(i)))
	}
	for a := b.next(wait); a.Seq < 4; a = b.next(wait) {
	}
	s.Restart()
	select {
	case <-reconnected:
	case <-time.After(wait):
		t.Fatal("no reconnect")
	}
	b.add(msg("outgoing.g.dev.t", "v-5"))
	if a := b.next(wait); a.Error == nil || a.Error.ErrorCode != 10208 {
		t.Fatalf("message 5 after the restart: %s, want error 10208 (batch unknown)", a)
	}
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), ids("v-", 1, 4))
}
