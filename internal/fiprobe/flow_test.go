package fiprobe_test

import (
	"strconv"
	"testing"
)

// TestFlowAcksCarryOnlyTheBatchSequence: with one batch on the stream, the server acknowledges
// every min(500, the client's flow) messages, and an acknowledgement carries nothing but the
// batch sequence persisted up to (and the next interval): no stream sequences, no duplicate
// count. The first answer (sequence 0) comes before the first message is stored: it confirms
// nothing. The final PubAck carries the stream sequence of the last message stored and the
// batch's count. (nats-server jetstream_batching.go fastBatchInit, checkFlowControl;
// stream.go processJetStreamFastBatchMsg)
func TestFlowAcksCarryOnlyTheBatchSequence(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		flow, every int
	}{
		{flow: 500, every: 500},
		{flow: 1000, every: 500}, // the server's cap
		{flow: 100, every: 100},  // the client's cap (jetstreamext's default)
	} {
		t.Run("flow="+strconv.Itoa(tc.flow), func(t *testing.T) {
			_, nc, js := outgoing(t, nil)
			const n = 1200
			b := newBatch(t, nc, tc.flow, false)
			for i := 1; i <= n; i++ {
				b.add(msg("outgoing.g.dev.t", "m-"+strconv.Itoa(i)))
			}
			b.end("outgoing.g.dev.t")
			flow, ack := b.until(wait)
			var want []uint64
			for s := 0; s <= n; s += tc.every {
				want = append(want, uint64(s))
			}
			if len(flow) != len(want) {
				t.Fatalf("%d flow acknowledgements %v, want %d at batch sequences %v", len(flow), flow, len(want), want)
			}
			for i, a := range flow {
				if a.Type != "ack" || a.Seq != want[i] || a.Msgs != tc.every {
					t.Fatalf("flow acknowledgement %d = %s, want type ack, seq %d, msgs %d", i, a, want[i], tc.every)
				}
				if w := `{"type":"ack","seq":` + strconv.FormatUint(want[i], 10) + `,"msgs":` + strconv.Itoa(tc.every) + `}`; a.Raw != w {
					t.Fatalf("flow acknowledgement %d = %s, want exactly %s", i, a.Raw, w)
				}
			}
			if ack.Stream != "OUTGOING" || ack.Seq != n || ack.Count != n || ack.Batch != b.id() || ack.Error != nil {
				t.Fatalf("PubAck %s, want stream OUTGOING, seq %d, count %d, batch %s", ack, n, n, b.id())
			}
			sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), ids("m-", 1, n))
		})
	}
}

// TestFlowAcksWithConcurrentBatches: a batch that starts while another is open is acknowledged
// after every message at first, and its interval doubles with each acknowledgement up to
// 500/N for N open batches; the first batch, acknowledged every 500 while alone, is slowed
// down to 500/N by halving.
func TestFlowAcksWithConcurrentBatches(t *testing.T) {
	t.Parallel()
	_, nc, js := outgoing(t, nil)
	const n, rounds = 4, 800
	bs := make([]*batch, n)
	for i := range bs {
		bs[i] = newBatch(t, nc, 500, false)
	}
	for r := 1; r <= rounds; r++ {
		for i, b := range bs {
			b.add(msg("outgoing.g.dev.t", "b"+strconv.Itoa(i)+"-"+strconv.Itoa(r)))
		}
	}
	for _, b := range bs {
		b.end("outgoing.g.dev.t")
	}
	for i, b := range bs {
		flow, ack := b.until(wait)
		var msgs []int
		for _, a := range flow {
			msgs = append(msgs, a.Msgs)
		}
		t.Logf("batch %d: %d flow acknowledgements, intervals %v; PubAck count %d", i, len(flow), msgs, ack.Count)
		if ack.Count != rounds || ack.Error != nil {
			t.Fatalf("batch %d: PubAck %s, want count %d", i, ack, rounds)
		}
		if i == 0 && msgs[0] != 500 {
			t.Fatalf("batch 0: first interval %d, want 500 (alone when it started)", msgs[0])
		}
		if i > 0 && (msgs[0] != 1 || msgs[1] != 2) {
			t.Fatalf("batch %d: intervals %v, want 1, 2, … (others open when it started)", i, msgs)
		}
		if last := msgs[len(msgs)-1]; last != 500/n {
			t.Fatalf("batch %d: last interval %d, want 500/%d = %d", i, last, n, 500/n)
		}
	}
	if got := len(stored(t, js, "OUTGOING")); got != n*rounds {
		t.Fatalf("OUTGOING holds %d, want %d", got, n*rounds)
	}
}
