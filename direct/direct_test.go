package direct_test

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// The names direct shares with the rest of kvmapper must be the same strings.
func TestSharedNames(t *testing.T) {
	for _, c := range [][2]string{
		{wire.ReasonMalformedSubject, wire.ReasonMalformedSubject},
		{wire.HeaderReason, wire.HeaderReason},
		{wire.HeaderSubject, wire.HeaderSubject},
		{wire.HeaderProvenance, wire.HeaderProvenance},
		{wire.HeaderProbe, wire.HeaderProbe},
		{string(wire.ReceiveMapping), string(wire.ReceiveMapping)},
		{string(wire.ReceiveAll), string(wire.ReceiveAll)},
	} {
		if c[0] != c[1] {
			t.Errorf("direct has %q where the others have %q", c[0], c[1])
		}
	}
}

// A device publishing with nats.go's js.Publish gets its acknowledgement from OUTGOING: the
// stream, the sequence its message was stored at, and OUTGOING's duplicate detection of its
// own Msg-Id.
func TestPubAckComesFromOutgoing(t *testing.T) {
	eachReceive(t, func(t *testing.T, f *fixture) {
		f.groups.set("dev-42", "group-a")
		p := f.pool("r1", nil, nil)
		f.runAll(p, 1)
		ctx := context.Background()
		ack, err := f.js.Publish(ctx, "incoming.dev-42.temp", []byte("21.5"), jetstream.WithMsgID("m-1"))
		if err != nil {
			t.Fatalf("Publish: %v", err)
		}
		if ack.Stream != "OUTGOING" || ack.Sequence != 1 || ack.Duplicate {
			t.Fatalf("PubAck = %+v, want stream OUTGOING, sequence 1, not a duplicate", ack)
		}
		again, err := f.js.Publish(ctx, "incoming.dev-42.temp", []byte("21.5"), jetstream.WithMsgID("m-1"))
		if err != nil {
			t.Fatalf("second Publish: %v", err)
		}
		if again.Stream != "OUTGOING" || !again.Duplicate {
			t.Fatalf("PubAck of the resend = %+v, want OUTGOING's duplicate", again)
		}
		msgs := f.stream("OUTGOING")
		if len(msgs) != 1 || msgs[0].Subject() != "outgoing.group-a.dev-42.temp" || string(msgs[0].Data()) != "21.5" {
			t.Fatalf("OUTGOING holds %d messages (first %v), want one on outgoing.group-a.dev-42.temp", len(msgs), subjectsOf(msgs))
		}
		if st := p.Stats(); st.Mapped != 2 {
			t.Errorf("Stats().Mapped = %d, want 2 (the resend too)", st.Mapped)
		}
	})
}

// A device that is not mapped, or whose value is not a valid group, gets its acknowledgement
// from UNMAPPED, where its message carries the reason.
func TestUnmappedGetsPubAckFromUnmapped(t *testing.T) {
	eachReceive(t, func(t *testing.T, f *fixture) {
		f.groups.set("dev-bad", "a.b")
		p := f.pool("r1", nil, nil)
		f.runAll(p, 1)
		ctx := context.Background()
		for _, dev := range []string{"dev-99", "dev-bad"} {
			ack, err := f.js.Publish(ctx, "incoming."+dev+".temp", []byte("who?"))
			if err != nil {
				t.Fatalf("Publish(%s): %v", dev, err)
			}
			if ack.Stream != "UNMAPPED" {
				t.Fatalf("PubAck(%s) = %+v, want stream UNMAPPED", dev, ack)
			}
		}
		msgs := f.stream("UNMAPPED")
		want := []struct{ subject, reason string }{
			{"unmapped.dev-99.temp", wire.ReasonNoMapping}, {"unmapped.dev-bad.temp", wire.ReasonInvalidGroup},
		}
		if len(msgs) != len(want) {
			t.Fatalf("UNMAPPED holds %v, want %d messages", subjectsOf(msgs), len(want))
		}
		for i, w := range want {
			m := msgs[i]
			if m.Subject() != w.subject || m.Headers().Get(wire.HeaderReason) != w.reason || string(m.Data()) != "who?" {
				t.Errorf("UNMAPPED message %d: %s reason %q payload %q, want %s reason %q", i, m.Subject(), m.Headers().Get(wire.HeaderReason), m.Data(), w.subject, w.reason)
			}
		}
		if st := p.Stats(); st.Unmapped[wire.ReasonNoMapping] != 1 || st.Unmapped[wire.ReasonInvalidGroup] != 1 {
			t.Errorf("Stats().Unmapped = %v, want one of each", st.Unmapped)
		}
	})
}

// A subject that does not fit the template (published straight to a partition's mapped form)
// goes to UNMAPPED with its reason, and its publisher's acknowledgement comes from there.
func TestMalformedSubjectGoesToUnmapped(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	p := f.pool("r1", nil, nil)
	f.run(p, direct.Assignment{Partition: 3, Epoch: 1})
	ack, err := f.js.Publish(context.Background(), "incoming.3.dev-1.temp.extra", []byte("x"))
	if err != nil {
		t.Fatalf("Publish: %v", err)
	}
	if ack.Stream != "UNMAPPED" {
		t.Fatalf("PubAck = %+v, want stream UNMAPPED", ack)
	}
	msgs := f.stream("UNMAPPED")
	if len(msgs) != 1 || msgs[0].Subject() != f.lay.MalformedSubject() ||
		msgs[0].Headers().Get(wire.HeaderReason) != wire.ReasonMalformedSubject ||
		msgs[0].Headers().Get(wire.HeaderSubject) != "incoming.3.dev-1.temp.extra" {
		t.Fatalf("UNMAPPED holds %v, want the message on %s with reason %s and its subject", subjectsOf(msgs), f.lay.MalformedSubject(), wire.ReasonMalformedSubject)
	}
}

// A message OUTGOING refuses for its size: the device gets OUTGOING's own error, as it would
// publishing into OUTGOING.
func TestTooLargeForOutgoingGetsOutgoingsError(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping, func(ctx context.Context, js jetstream.JetStream) {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTGOING", Subjects: []string{"outgoing.>"},
			Duplicates: 2 * time.Minute, MaxMsgSize: 1024}); err != nil {
			t.Fatal(err)
		}
	})
	f.groups.set("dev-42", "group-a")
	p := f.pool("r1", nil, nil)
	f.runAll(p, 1)
	_, err := f.js.Publish(context.Background(), "incoming.dev-42.temp", make([]byte, 2000))
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamMessageExceedsMaximum {
		t.Fatalf("Publish of 2000 B into an OUTGOING of 1024 B = %v, want OUTGOING's error %d", err, jetstream.JSErrCodeStreamMessageExceedsMaximum)
	}
}

// The payload arrives byte for byte; the device's headers, its Nats-Msg-Id and a
// Nats-Expected-Stream naming OUTGOING among them, arrive as they were sent; the pool adds its
// provenance headers when asked to and nothing else, and by default nothing at all.
func TestHeadersAndPayloadPassThrough(t *testing.T) {
	payload := []byte{0, 1, 2, 0xff, '\n', 0, 'x'}
	for _, noProv := range []bool{false, true} {
		t.Run(map[bool]string{false: "provenance", true: "no-provenance"}[noProv], func(t *testing.T) {
			f := newFixture(t, wire.ReceiveMapping)
			f.groups.set("dev-7", "group-a")
			p := f.pool("r1", nil, func(c *direct.Config) { c.Provenance = !noProv })
			f.runAll(p, 5)
			m := nats.NewMsg("incoming.dev-7.temp")
			m.Data = payload
			m.Header.Set("X-Trace", "abc")
			m.Header.Add("X-Multi", "1")
			m.Header.Add("X-Multi", "2")
			m.Header.Set(jetstream.MsgIDHeader, "dev-7:1")
			m.Header.Set(jetstream.ExpectedStreamHeader, "OUTGOING")
			// A device cannot pass provenance off, in either spelling (left out below).
			m.Header.Set(wire.HeaderProvenance, "1.2.3")
			m.Header.Set(wire.HeaderEpoch, "999")
			ack, err := f.js.PublishMsg(context.Background(), m)
			if err != nil || ack.Stream != "OUTGOING" {
				t.Fatalf("PublishMsg = %+v, %v; want OUTGOING's acknowledgement", ack, err)
			}
			got := f.stream("OUTGOING")
			if len(got) != 1 {
				t.Fatalf("OUTGOING holds %d messages, want 1", len(got))
			}
			if !bytes.Equal(got[0].Data(), payload) {
				t.Errorf("payload %q, want %q", got[0].Data(), payload)
			}
			h := got[0].Headers()
			want := map[string][]string{
				"X-Trace": {"abc"}, "X-Multi": {"1", "2"},
				jetstream.MsgIDHeader: {"dev-7:1"}, jetstream.ExpectedStreamHeader: {"OUTGOING"},
			}
			if !noProv {
				want[wire.HeaderProvenance] = []string{strconv.Itoa(subjects.Partition("dev-7", partitions)) + ".5.1"}
			}
			keys, wantKeys := slices.Sorted(maps.Keys(h)), slices.Sorted(maps.Keys(want))
			if !slices.Equal(keys, wantKeys) {
				t.Fatalf("headers %v, want exactly %v", keys, wantKeys)
			}
			for k, v := range want {
				if !slices.Equal(h.Values(k), v) {
					t.Errorf("header %s = %v, want %v", k, h.Values(k), v)
				}
			}
		})
	}
}

func subjectsOf(msgs []jetstream.Msg) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.Subject()
	}
	return out
}
