package replay_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/replay"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// A replay maps every message of the range, in each device's order, with the headers the live
// mapper sets, and dead-letters what it cannot map, with the live mapper's reasons.
func TestReplayMapsARange(t *testing.T) {
	eachLayout(t, func(t *testing.T, f *fixture) {
		devs := devices("dev-", 12)
		for i, d := range devs {
			f.put(d, fmt.Sprintf("g%d", i%3))
		}
		revBad := f.put("bad", "a.b")
		f.publish(append(devs, "nomap", "bad"), 10)

		s := f.mustRun(f.config())
		n := uint64(len(devs) * 10)
		if s.Mapped != n || s.Reasons[wire.ReasonNoMapping] != 10 || s.Reasons[wire.ReasonInvalidGroup] != 10 || s.Read != n+20 {
			t.Errorf("summary: read %d, mapped %d, unmapped %v; want %d, %d, 10 of each reason", s.Read, s.Mapped, s.Reasons, n+20, n)
		}
		if s.Groups["g0"] != 40 || s.Into != "REPLAY" || s.DeadLetters != "REPLAY" {
			t.Errorf("summary: groups %v, into %s, dead letters %s; want g0: 40, REPLAY, REPLAY", s.Groups, s.Into, s.DeadLetters)
		}
		in := f.incoming()
		msgs := f.read("REPLAY")
		if len(msgs) != len(in) {
			t.Fatalf("REPLAY holds %d messages, want %d", len(msgs), len(in))
		}
		subs := perDevice(t, msgs)
		for i, d := range devs {
			if want := fmt.Sprintf("replay.g%d.%s.evt", i%3, d); subs[d][0] != want || subs[d][9] != want {
				t.Errorf("device %s replayed to %s, want %s", d, subs[d][0], want)
			}
		}
		if subs["nomap"][0] != "replay-unmapped.nomap.evt" || subs["bad"][0] != "replay-unmapped.bad.evt" {
			t.Errorf("dead letters on %s and %s, want replay-unmapped.{nomap,bad}.evt", subs["nomap"][0], subs["bad"][0])
		}
		for _, m := range msgs {
			h := m.Headers()
			src := in[string(m.Data())] // "<stream>:<seq>"
			stream, seq, _ := strings.Cut(src, ":")
			info, err := f.js.Stream(context.Background(), stream)
			if err != nil {
				t.Fatal(err)
			}
			want := "replay:" + s.ID + ":" + wire.MsgIDPrefix(stream, wire.Incarnation(info.CachedInfo().Created)) + seq
			if got := h.Get(nats.MsgIdHdr); got != want {
				t.Fatalf("message %q: Nats-Msg-Id %q, want %q", m.Data(), got, want)
			}
			dev, _, _ := strings.Cut(string(m.Data()), ":")
			pv, _ := wire.ReadProvenance(h.Get)
			if !pv.HasPartition || pv.Partition != subjects.Partition(dev, 16) {
				t.Errorf("message %q: %s %q, want partition %d", m.Data(), wire.HeaderProvenance, h.Get(wire.HeaderProvenance), subjects.Partition(dev, 16))
			}
			if h.Get(wire.HeaderReplay) != s.ID || pv.Epoch != 0 {
				t.Errorf("message %q: %s %q, %s %q; want the replay's id and no epoch", m.Data(), wire.HeaderReplay, h.Get(wire.HeaderReplay), wire.HeaderProvenance, h.Get(wire.HeaderProvenance))
			}
			switch dev {
			case "nomap":
				if h.Get(wire.HeaderReason) != wire.ReasonNoMapping {
					t.Errorf("message %q: reason %q, want %s", m.Data(), h.Get(wire.HeaderReason), wire.ReasonNoMapping)
				}
			case "bad":
				if h.Get(wire.HeaderReason) != wire.ReasonInvalidGroup || pv.Revision != 0 {
					t.Errorf("message %q: reason %q, provenance %q; want %s and no revision (rev %d is invalid)", m.Data(), h.Get(wire.HeaderReason), h.Get(wire.HeaderProvenance), wire.ReasonInvalidGroup, revBad)
				}
			default:
				if pv.Revision == 0 || h.Get(wire.HeaderReason) != "" {
					t.Errorf("message %q: provenance %q, reason %q; want the mapping's revision and no reason", m.Data(), h.Get(wire.HeaderProvenance), h.Get(wire.HeaderReason))
				}
			}
		}

		// Running the same replay again changes nothing: it is complete.
		again := f.mustRun(f.config())
		if !again.AlreadyComplete || again.ID != s.ID || again.Read != 0 {
			t.Errorf("second run: already complete %v, id %s (first %s), read %d; want true, the same id, 0", again.AlreadyComplete, again.ID, s.ID, again.Read)
		}
		if n := len(f.read("REPLAY")); n != len(in) {
			t.Errorf("after the second run REPLAY holds %d messages, want %d", n, len(in))
		}
	})
}

// As of a revision before a move, the moved device maps to its old group; as of now (or a
// time after the move) to the new one.
func TestAsOfBeforeAMove(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	f.put("steady", "g-s")
	before := f.put("mover", "g-old")
	old, err := f.groups.GetRevision(context.Background(), "mover", before)
	if err != nil {
		t.Fatal(err)
	}
	between := old.Created() // as of the very time of the old value's write, which counts
	f.publish([]string{"mover", "steady"}, 5)
	f.put("mover", "g-new")
	f.publish([]string{"mover", "steady"}, 5)

	for _, c := range []struct {
		name string
		into string
		asOf replay.AsOf
		want string
	}{
		{"revision before", "R1", replay.AsOf{Revision: before}, "g-old"},
		{"time before", "R2", replay.AsOf{Time: between}, "g-old"},
		{"now", "R3", replay.AsOf{}, "g-new"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := f.config()
			cfg.Into, cfg.AsOf = c.into, c.asOf
			cfg.Layout = f.layout(strings.ToLower(c.into)+".{group}.{device}.{event}", strings.ToLower(c.into)+"-unmapped.{device}.{event}")
			s := f.mustRun(cfg)
			subs := perDevice(t, f.read(c.into))
			if len(subs["mover"]) != 10 {
				t.Fatalf("%d messages of mover, want 10", len(subs["mover"]))
			}
			for i, sub := range subs["mover"] {
				if want := strings.ToLower(c.into) + "." + c.want + ".mover.evt"; sub != want {
					t.Errorf("mover's message %d on %s, want %s (as of revision %d)", i, sub, want, s.AsOf)
				}
			}
			if subs["steady"][9] != strings.ToLower(c.into)+".g-s.steady.evt" {
				t.Errorf("steady's last message on %s", subs["steady"][9])
			}
		})
	}
}

// When the bucket no longer holds a device's value at the as-of revision, the replay refuses,
// naming the count, unless allowed: then only that device's messages are dead-lettered.
func TestHistoryShorterThanAsked(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	ctx := context.Background()
	if err := f.js.DeleteKeyValue(ctx, f.names.Groups); err != nil {
		t.Fatal(err)
	}
	b, err := f.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: f.names.Groups, History: 2})
	if err != nil {
		t.Fatal(err)
	}
	f.groups = b
	rev := f.put("busy", "g1")
	f.put("calm", "g1")
	f.publish([]string{"busy", "calm"}, 3)
	f.put("busy", "g2")
	f.put("busy", "g3") // the bucket keeps two values of busy: g1 is gone

	cfg := f.config()
	cfg.AsOf = replay.AsOf{Revision: rev + 1}
	_, err = f.run(cfg)
	if !errors.Is(err, replay.ErrHistoryIncomplete) || !strings.Contains(err.Error(), "1 devices") || !strings.Contains(err.Error(), "busy") {
		t.Fatalf("Run as of revision %d = %v, want ErrHistoryIncomplete naming 1 device, busy", rev+1, err)
	}
	if n := len(f.read("REPLAY")); n != 0 {
		t.Fatalf("a refused replay stored %d messages", n)
	}
	cfg.AllowMissingHistory = true
	s := f.mustRun(cfg)
	if s.Unknown != 1 || s.Reasons[replay.ReasonHistoryMissing] != 3 || s.Mapped != 3 {
		t.Errorf("summary: unknown %d, unmapped %v, mapped %d; want 1, %s: 3, 3", s.Unknown, s.Reasons, s.Mapped, replay.ReasonHistoryMissing)
	}
	subs := perDevice(t, f.read("REPLAY"))
	if subs["busy"][0] != "replay-unmapped.busy.evt" || subs["calm"][0] != "replay.g1.calm.evt" {
		t.Errorf("busy on %s, calm on %s; want replay-unmapped.busy.evt, replay.g1.calm.evt", subs["busy"][0], subs["calm"][0])
	}
	// --devices narrows the check to the devices replayed.
	cfg.AllowMissingHistory, cfg.Devices, cfg.Into = false, []string{"calm"}, "REPLAY"
	if _, err := f.run(cfg); err != nil {
		t.Errorf("Run for calm alone: %v, want no complaint about busy", err)
	}
}

// Headers follow the live mapper's rules: a device's own Nats-Msg-Id is kept under another name,
// the Nats-Expected-* headers (which addressed INCOMING) are dropped, the others are copied.
func TestHeadersAsTheLiveMapperKeepsThem(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	f.put("dev", "g")
	m := &nats.Msg{Subject: "incoming.dev.evt", Data: []byte("dev:0"), Header: nats.Header{}}
	m.Header.Set(nats.MsgIdHdr, "own-1")
	m.Header.Set("Nats-Expected-Stream", "INCOMING")
	m.Header.Set("X-Trace", "abc")
	if _, err := f.js.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	f.mustRun(f.config())
	got := f.read("REPLAY")[0].Headers()
	if got.Get(wire.HeaderOrigMsgID) != "own-1" || got.Get("Nats-Expected-Stream") != "" || got.Get("X-Trace") != "abc" ||
		!strings.HasPrefix(got.Get(nats.MsgIdHdr), "replay:") {
		t.Errorf("replayed headers %v, want %s own-1, no Nats-Expected-Stream, X-Trace abc, the replay's Nats-Msg-Id", got, wire.HeaderOrigMsgID)
	}
}
