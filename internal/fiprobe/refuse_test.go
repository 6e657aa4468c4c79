package fiprobe_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// TestDuplicatesInABatchAreSkippedSilently: a message whose Nats-Msg-Id the stream holds
// (stored before, or earlier in the same batch) is skipped with no answer of its own, and the
// batch goes on; neither the flow acknowledgements nor the final PubAck say how many were
// skipped or which (count is the batch's message count). A batch of nothing but duplicates
// ends with a PubAck of stream sequence 0. (stream.go processJetStreamFastBatchMsg, the
// errMsgIdDuplicate branch; jetstream_batching.go checkMsgHeadersPreClusteredProposal)
func TestDuplicatesInABatchAreSkippedSilently(t *testing.T) {
	t.Parallel()
	_, nc, js := outgoing(t, nil)
	publish(t, js, msg("outgoing.g.dev.t", "d-3"), msg("outgoing.g.dev.t", "d-7"))

	b := newBatch(t, nc, 500, false)
	for _, id := range []string{"d-1", "d-2", "d-3", "d-4", "d-5", "d-6", "d-7", "d-8", "d-2", "d-9"} {
		b.add(msg("outgoing.g.dev.t", id))
	}
	b.end("outgoing.g.dev.t")
	flow, ack := b.until(wait)
	if len(flow) != 1 || flow[0].Seq != 0 {
		t.Fatalf("flow acknowledgements %v, want only the first (seq 0)", flow)
	}
	if ack.Count != 10 || ack.Duplicate || ack.Error != nil || ack.Seq != 9 {
		t.Fatalf("PubAck %s, want count 10 (messages sent), stream seq 9 (2 stored before + 7), no duplicate flag", ack)
	}
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), []string{"d-3", "d-7", "d-1", "d-2", "d-4", "d-5", "d-6", "d-8", "d-9"})

	t.Run("first message", func(t *testing.T) {
		b := newBatch(t, nc, 500, false)
		b.add(msg("outgoing.g.dev.t", "d-1"))
		b.add(msg("outgoing.g.dev.t", "d-10"))
		b.end("outgoing.g.dev.t")
		if _, ack := b.until(wait); ack.Count != 2 || ack.Error != nil || ack.Duplicate {
			t.Fatalf("PubAck %s, want count 2: a duplicate first message does not end the batch", ack)
		}
	})
	t.Run("all", func(t *testing.T) {
		b := newBatch(t, nc, 500, false)
		b.add(msg("outgoing.g.dev.t", "d-4"))
		b.add(msg("outgoing.g.dev.t", "d-5"))
		b.end("outgoing.g.dev.t")
		if _, ack := b.until(wait); ack.Count != 2 || ack.Seq != 0 || ack.Error != nil || ack.Duplicate {
			t.Fatalf("PubAck %s, want count 2, stream seq 0", ack)
		}
	})
	t.Run("commit message", func(t *testing.T) {
		b := newBatch(t, nc, 500, false)
		b.add(msg("outgoing.g.dev.t", "d-11"))
		b.commit(msg("outgoing.g.dev.t", "d-6"))
		if _, ack := b.until(wait); ack.Count != 2 || ack.Error != nil || ack.Duplicate {
			t.Fatalf("PubAck %s, want count 2", ack)
		}
	})
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), []string{"d-3", "d-7", "d-1", "d-2", "d-4", "d-5", "d-6", "d-8", "d-9", "d-10", "d-11"})
}

// TestRefusedMessageEndsTheBatch: a message the stream refuses ends a gap-fail batch; the
// PubAck counts the messages before it, and the messages after it are not stored. The
// client learns which message and why: a refusal found while checking the message's headers
// (a per-message TTL, a rollup, an expected stream) comes as {"type":"err","seq":<batch seq>,
// "error":{…}}; one found before the batch is even looked at (too large for the stream) comes
// as a plain error PubAck on that message's reply subject, and the next message then reads
// as a gap. Both are core messages: they can be lost, and then the PubAck's count still tells
// where the batch stopped. With gap: ok the batch goes on past the refused message.
func TestRefusedMessageEndsTheBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		cfg    func(*jetstream.StreamConfig)
		bad    []string // headers of message 4
		big    bool     // message 4 too large instead
		gapOK  bool
		errTyp string // "err", or "" for an error PubAck
		code   int    // err_code
	}{
		{name: "ttl disabled", bad: []string{"Nats-TTL", "1m"}, errTyp: "err", code: 10166},
		{name: "ttl invalid", cfg: func(c *jetstream.StreamConfig) { c.AllowMsgTTL = true }, bad: []string{"Nats-TTL", "soon"}, errTyp: "err", code: 10165},
		{name: "rollup denied", bad: []string{"Nats-Rollup", "sub"}, errTyp: "err", code: 10111}, // code 500, not 400
		{name: "expected stream", bad: []string{"Nats-Expected-Stream", "INCOMING"}, errTyp: "err", code: 10060},
		{name: "too large", cfg: func(c *jetstream.StreamConfig) { c.MaxMsgSize = 512 }, big: true, errTyp: "", code: 10054},
		{name: "ttl disabled gap ok", bad: []string{"Nats-TTL", "1m"}, gapOK: true, errTyp: "err", code: 10166},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, nc, js := outgoing(t, tc.cfg)
			b := newBatch(t, nc, 500, tc.gapOK)
			for i := 1; i <= 8; i++ {
				m := msg("outgoing.g.dev.t", "r-"+string(rune('0'+i)))
				if i == 4 {
					for k := 0; k+1 < len(tc.bad); k += 2 {
						m.Header.Set(tc.bad[k], tc.bad[k+1])
					}
					if tc.big {
						m.Data = make([]byte, 1024)
					}
				}
				b.add(m)
			}
			b.end("outgoing.g.dev.t")
			got, ack := b.all(wait)
			var refusal *answer
			for i, a := range got {
				if a.On == 4 && a.Error != nil {
					refusal = &got[i]
					break
				}
			}
			if refusal == nil {
				t.Fatalf("no refusal of message 4 among %v", got)
			}
			if refusal.Error.ErrorCode != jetstream.ErrorCode(tc.code) || refusal.Type != tc.errTyp {
				t.Fatalf("refusal %s: type %q, error %s; want type %q, err_code %d", refusal, refusal.Type, errCode(*refusal), tc.errTyp, tc.code)
			}
			t.Logf("refusal: %s", refusal.Raw)
			ids := stored(t, js, "OUTGOING")
			if tc.gapOK {
				if ack.Count != 8 {
					t.Fatalf("gap ok: PubAck %s, want count 8", ack)
				}
				sameIDs(t, "OUTGOING", ids, []string{"r-1", "r-2", "r-3", "r-5", "r-6", "r-7", "r-8"})
				return
			}
			if ack.Count != 3 || ack.Seq != 3 {
				t.Fatalf("PubAck %s, want count 3 and stream seq 3: the batch ends before the refused message", ack)
			}
			sameIDs(t, "OUTGOING", ids, []string{"r-1", "r-2", "r-3"})
			for _, a := range got {
				if a.On > 4 && a.Type == "gap" {
					t.Logf("message %d: %s (the refused message left a hole)", a.On, a.Raw)
				}
				if a.On > 4 && a.Error != nil && a.Error.ErrorCode != 10208 {
					t.Fatalf("message %d after the refused one: %s, want nothing or 10208 (batch unknown)", a.On, a)
				}
			}
		})
	}
}

// TestRefusedFirstMessage: when the first message of a gap-fail batch is refused, the answer is
// a plain error PubAck (after the first flow acknowledgement, sent before the check) and the
// batch is gone: its next message is refused as belonging to an unknown batch.
func TestRefusedFirstMessage(t *testing.T) {
	t.Parallel()
	_, nc, js := outgoing(t, nil)
	b := newBatch(t, nc, 500, false)
	b.add(msg("outgoing.g.dev.t", "f-1", "Nats-TTL", "1m"))
	flow, ack := b.until(wait)
	if len(flow) != 1 || flow[0].Type != "ack" || flow[0].Seq != 0 {
		t.Fatalf("flow %v, want the first acknowledgement (seq 0) before the refusal", flow)
	}
	if ack.Error == nil || ack.Error.ErrorCode != 10166 || ack.On != 1 {
		t.Fatalf("PubAck %s, want error 10166 on message 1", ack)
	}
	b.add(msg("outgoing.g.dev.t", "f-2"))
	if _, ack := b.until(wait); ack.Error == nil || ack.Error.ErrorCode != 10208 || !strings.Contains(ack.Error.Description, "unknown") {
		t.Fatalf("message 2: %s, want error 10208 (batch publish ID unknown)", ack)
	}
	if got := stored(t, js, "OUTGOING"); len(got) != 0 {
		t.Fatalf("OUTGOING holds %v, want nothing", got)
	}
}

// TestRollupRefusalIsNotABadRequest: OUTGOING (no allow_rollup_hdrs) refuses a message carrying
// Nats-Rollup with code 500, not 400, whether it comes in a batch (above) or alone: a write path
// that takes only 400s as "about the message" would resend it forever.
func TestRollupRefusalIsNotABadRequest(t *testing.T) {
	t.Parallel()
	_, _, js := outgoing(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	_, err := js.PublishMsg(ctx, msg("outgoing.g.dev.t", "u-1", "Nats-Rollup", "sub"))
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.Code != 500 || apiErr.ErrorCode != 10111 {
		t.Fatalf("PublishMsg with Nats-Rollup: %v, want an APIError 500/10111", err)
	}
	t.Logf("plain publish with Nats-Rollup: code %d, err_code %d, %q", apiErr.Code, apiErr.ErrorCode, apiErr.Description)
}
