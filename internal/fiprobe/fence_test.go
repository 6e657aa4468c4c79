package fiprobe_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// These probes pin down what an output-side fence can rest on (docs/design-fencing.md): a
// message carrying Nats-Expected-Last-Subject-Sequence with Nats-Expected-Last-Subject-Sequence-Subject
// naming a fence subject in the same stream is stored only while the fence subject's last
// message is the one it names, so a new owner that writes the fence subject refuses every later
// write of the old one. What matters is what that costs on a replicated stream, and what it
// leaves open in a batch.

// The headers of an expected-last-subject-sequence check on another subject (nats-server 2.11+,
// stream.go JSExpectedLastSubjSeq, JSExpectedLastSubjSeqSubj).
const (
	hdrExpectSeq  = "Nats-Expected-Last-Subject-Sequence"
	hdrExpectSubj = "Nats-Expected-Last-Subject-Sequence-Subject"
	fenceSubject  = "kvmapper.fence.0"
)

// fenced is m with a check that fenceSubject's last message is at stream sequence seq.
func fenced(m *nats.Msg, seq uint64) *nats.Msg {
	m.Header.Set(hdrExpectSeq, strconv.FormatUint(seq, 10))
	m.Header.Set(hdrExpectSubj, fenceSubject)
	return m
}

// fenceOutgoing creates OUTGOING with the fence subjects beside outgoing.>, atomic and fast
// batches allowed, and writes the fence once; it returns the fence's stream sequence.
func fenceOutgoing(t *testing.T, js jetstream.JetStream, replicas int) uint64 {
	t.Helper()
	createOutgoing(t, js, replicas, func(c *jetstream.StreamConfig) {
		c.Subjects = append(c.Subjects, "kvmapper.fence.>")
		c.AllowAtomicPublish = true
	})
	return bumpFence(t, js)
}

// bumpFence writes the fence subject, as a new owner would on takeover, and returns its
// stream sequence.
func bumpFence(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	ack, err := js.PublishMsg(ctx, msg(fenceSubject, ""))
	if err != nil {
		t.Fatalf("writing the fence: %v", err)
	}
	return ack.Sequence
}

// pubAnswer is a PubAck or its error.
type pubAnswer struct {
	Stream    string              `json:"stream"`
	Seq       uint64              `json:"seq"`
	Duplicate bool                `json:"duplicate"`
	Batch     string              `json:"batch"`
	Count     int                 `json:"count"`
	Error     *jetstream.APIError `json:"error"`
}

func (a pubAnswer) code() int {
	if a.Error == nil {
		return 0
	}
	return int(a.Error.ErrorCode)
}

// pipeline sends msgs back to back, each with a reply subject of its own, and returns the
// answers in the order of msgs.
func pipeline(t *testing.T, nc *nats.Conn, msgs []*nats.Msg) []pubAnswer {
	t.Helper()
	inbox := nc.NewInbox()
	ch := make(chan *nats.Msg, len(msgs))
	sub, err := nc.ChanSubscribe(inbox+".*", ch)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	for i, m := range msgs {
		m.Reply = inbox + "." + strconv.Itoa(i)
		if err := nc.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
	}
	out := make([]pubAnswer, len(msgs))
	for range msgs {
		select {
		case m := <-ch:
			i, _ := strconv.Atoi(m.Subject[len(inbox)+1:])
			if err := json.Unmarshal(m.Data, &out[i]); err != nil {
				t.Fatalf("answer %q: %v", m.Data, err)
			}
		case <-time.After(wait):
			t.Fatalf("not every publish answered within %v", wait)
		}
	}
	return out
}

// TestFenceCheckPerMessage: on one server, every message of a pipeline may carry the fence check
// and all are stored. On a replicated stream, the leader lets only one message checking a given
// subject be proposed and not yet applied (jetstream_batching.go checkMsgHeadersPreClusteredProposal:
// expectedPerSubjectInProcess), and refuses the others at once with 400/10164 "wrong last
// sequence" — so a writer that checks the fence on every message can have one message in flight
// per partition, and one that pipelines sees later messages stored around refused earlier ones:
// a reorder. The headers are stored with the message: downstream sees them.
func TestFenceCheckPerMessage(t *testing.T) {
	t.Parallel()
	const n = 200
	run := func(t *testing.T, nc *nats.Conn, js jetstream.JetStream, replicas int) (refused, storedAfter int) {
		f := fenceOutgoing(t, js, replicas)
		var msgs []*nats.Msg
		for i := range n {
			msgs = append(msgs, fenced(msg("outgoing.g.dev.t", "p-"+strconv.Itoa(i)), f))
		}
		first := -1
		for i, a := range pipeline(t, nc, msgs) {
			switch {
			case a.Error == nil:
				if first >= 0 {
					storedAfter++
				}
			case a.code() == 10164:
				refused++
				if first < 0 {
					first = i
				}
			default:
				t.Fatalf("message %d: %+v, want stored or 10164", i, a.Error)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		s, err := js.Stream(ctx, "OUTGOING")
		if err != nil {
			t.Fatal(err)
		}
		m, err := s.GetMsg(ctx, f+1)
		if err != nil {
			t.Fatal(err)
		}
		if m.Header.Get(hdrExpectSeq) != strconv.FormatUint(f, 10) || m.Header.Get(hdrExpectSubj) != fenceSubject {
			t.Errorf("stored message headers %v, want the fence check kept", m.Header)
		}
		t.Logf("R%d: %d of %d pipelined fenced publishes refused with 10164; %d stored after the first refusal", replicas, refused, n, storedAfter)
		return refused, storedAfter
	}
	t.Run("R1", func(t *testing.T) {
		nc, js := natstest.Start(t).JetStream(t)
		if refused, _ := run(t, nc, js, 1); refused != 0 {
			t.Errorf("%d refused on one server, want 0", refused)
		}
	})
	t.Run("R3", func(t *testing.T) {
		c := natstest.StartCluster(t, 3)
		nc := c.Connect(t, 0)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		if refused, _ := run(t, nc, js, 3); refused == 0 {
			t.Errorf("no pipelined fenced publish refused on R3: the server let more than one fence check be in process")
		}
	})
}

// TestFenceOnAFastBatchLeavesItsTail: a fence check on the first message of a fast-ingest batch
// checks only that message. A fence written while the batch is open (a new owner's takeover)
// does not end it: what the old owner sends on it afterwards is stored after the fence. Only
// its next batch is refused (400/10071, "wrong last sequence: <the fence's sequence>"). On a
// replicated stream a check on every message of the batch is no way out: the second one is
// refused as in process (10164), which ends a gap-fail batch.
func TestFenceOnAFastBatchLeavesItsTail(t *testing.T) {
	t.Parallel()
	c := natstest.StartCluster(t, 3)
	nc := c.Connect(t, 0)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	f := fenceOutgoing(t, js, 3)
	b := newBatch(t, nc, 500, false)
	b.add(fenced(msg("outgoing.g.dev.t", "t-1"), f))
	b.add(msg("outgoing.g.dev.t", "t-2"))
	if a := b.next(wait); a.Type != "ack" {
		t.Fatalf("first answer %s, want the first flow acknowledgement", a)
	}
	natstest.Eventually(t, wait, func() error {
		if n := len(stored(t, js, "OUTGOING")); n != 3 {
			return fmt.Errorf("OUTGOING holds %d, want 3", n)
		}
		return nil
	})
	f2 := bumpFence(t, js) // the takeover
	b.add(msg("outgoing.g.dev.t", "t-3"))
	b.end("outgoing.g.dev.t")
	if _, ack := b.all(wait); ack.Error != nil || ack.Count != 3 {
		t.Fatalf("PubAck %+v, want count 3: the open batch goes on past the fence", ack)
	}
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), []string{"", "t-1", "t-2", "", "t-3"})

	next := newBatch(t, nc, 500, false)
	next.add(fenced(msg("outgoing.g.dev.t", "t-4"), f))
	_, ack := next.until(wait)
	if ack.Error == nil || ack.Error.ErrorCode != 10071 {
		t.Fatalf("next batch of the old owner: %s, want 10071", ack)
	}
	t.Logf("next batch refused: %d %q", ack.Error.ErrorCode, ack.Error.Description)

	every := newBatch(t, nc, 500, false)
	for i := 5; i <= 8; i++ {
		every.add(fenced(msg("outgoing.g.dev.t", "t-"+strconv.Itoa(i)), f2))
	}
	got, ack := every.all(wait)
	t.Logf("a check on every message of a batch on R3: %v", got)
	if ack.Count >= 4 {
		t.Errorf("PubAck %s: every message stored, want the second refused as in process", ack)
	}
}

// atomicBatch publishes msgs as one atomic batch (Nats-Batch-Id, -Sequence, -Commit on the last),
// the staged messages without a reply subject (so that nothing answers them), and returns the
// commit's answer. hold, if set, runs after the staged messages and before the commit.
func atomicBatch(t *testing.T, nc *nats.Conn, id string, msgs []*nats.Msg, hold func()) pubAnswer {
	t.Helper()
	for i, m := range msgs {
		m.Header.Set("Nats-Batch-Id", id)
		m.Header.Set("Nats-Batch-Sequence", strconv.Itoa(i+1))
		if i == len(msgs)-1 {
			if hold != nil {
				if err := nc.Flush(); err != nil {
					t.Fatal(err)
				}
				hold()
			}
			m.Header.Set("Nats-Batch-Commit", "1")
			return pipeline(t, nc, []*nats.Msg{m})[0]
		}
		if err := nc.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
	}
	return pubAnswer{}
}

// TestFenceOnAnAtomicBatch: an atomic batch is checked at its commit, as a whole, and proposed as
// one: with the fence check on its first message, a batch whose commit comes after a new owner
// wrote the fence is refused entirely (10071) and nothing of it is stored, even when all its
// other messages were staged before the fence was written. A batch either precedes the fence in
// the stream or is not in it.
func TestFenceOnAnAtomicBatch(t *testing.T) {
	t.Parallel()
	c := natstest.StartCluster(t, 3)
	nc := c.Connect(t, 0)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	f := fenceOutgoing(t, js, 3)
	if a := atomicBatch(t, nc, "a", []*nats.Msg{
		fenced(msg("outgoing.g.dev.t", "a-1"), f), msg("outgoing.g.dev.t", "a-2"), msg("outgoing.g.dev.t", "a-3"),
	}, nil); a.Error != nil || a.Count != 3 {
		t.Fatalf("batch a: %+v, want count 3", a)
	}
	var f2 uint64
	a := atomicBatch(t, nc, "b", []*nats.Msg{
		fenced(msg("outgoing.g.dev.t", "b-1"), f), msg("outgoing.g.dev.t", "b-2"), msg("outgoing.g.dev.t", "b-3"),
	}, func() { f2 = bumpFence(t, js) })
	if a.code() != 10071 {
		t.Fatalf("batch b, committed after the fence was written: %+v, want refused with 10071", a)
	}
	t.Logf("batch b refused: %d %q", a.code(), a.Error.Description)
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), []string{"", "a-1", "a-2", "a-3", ""})
	if a := atomicBatch(t, nc, "c", []*nats.Msg{fenced(msg("outgoing.g.dev.t", "c-1"), f2), msg("outgoing.g.dev.t", "c-2")}, nil); a.Error != nil {
		t.Fatalf("batch c of the new owner: %+v", a)
	}
}
