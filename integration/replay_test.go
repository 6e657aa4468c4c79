package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/wire"
)

// replayLine is a JSON progress line of `kvmapper replay` (stdout not a terminal).
type replayLine struct {
	ID            string            `json:"id"`
	Done          uint64            `json:"done"`
	Total         uint64            `json:"total"`
	Final         bool              `json:"final"`
	Complete      bool              `json:"complete"`
	Mapped        uint64            `json:"mapped"`
	AlreadyStored uint64            `json:"already_stored"`
	Resumed       bool              `json:"resumed"`
	Groups        map[string]uint64 `json:"groups"`
}

// lastReplayLine returns the last progress line out holds.
func lastReplayLine(t *testing.T, out string) replayLine {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var l replayLine
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &l); err != nil {
		t.Fatalf("replay's last line %q is no progress line: %v", lines[len(lines)-1], err)
	}
	return l
}

// byID indexes msgs by the part of their Nats-Msg-Id after prefixes' first match: the INCOMING
// stream, incarnation and sequence, which the live mapper and a replay share.
func byID(t *testing.T, msgs []jetstream.Msg, prefix string) map[string]jetstream.Msg {
	t.Helper()
	out := map[string]jetstream.Msg{}
	for _, m := range msgs {
		id, ok := strings.CutPrefix(m.Headers().Get(nats.MsgIdHdr), prefix)
		if !ok {
			t.Fatalf("%s: Nats-Msg-Id %q does not start with %q", m.Subject(), m.Headers().Get(nats.MsgIdHdr), prefix)
		}
		if _, dup := out[id]; dup {
			t.Fatalf("%s stored twice", id)
		}
		out[id] = m
	}
	return out
}

// A range replayed into a new stream equals, message by message, what the live mapper stored
// when nothing changed in between: same subjects under the replay's prefix, payloads, headers
// (but the replay's Nats-Msg-Id and provenance), dead letters, and each device's order.
func TestReplayEqualsTheLiveMapper(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		devs := deviceNames("dev-", 20)
		for i, d := range devs {
			e.put(d, fmt.Sprintf("group-%d", i%4))
		}
		e.put("bad", "not valid")
		from := time.Now().Add(-time.Second)
		e.startMapper("m1")
		all := append(slices.Clone(devs), "stray", "bad")
		newLoad(t, e.js).publish(all, 15)
		live := e.readStream("OUTGOING", len(devs)*15, 30*time.Second)
		dead := e.readStream("UNMAPPED", 30, 30*time.Second)

		out, errOut, code := e.cli("replay", "--from-time", from.Format(time.RFC3339Nano), "--into", "REPLAY", "--create", "--log-format", "json")
		if code != 0 {
			t.Fatalf("replay: exit %d: %s", code, errOut)
		}
		l := lastReplayLine(t, out)
		if !l.Final || !l.Complete || l.Mapped != uint64(len(devs)*15) {
			t.Fatalf("replay's last line: %+v, want final, complete, %d mapped", l, len(devs)*15)
		}
		replayed := e.readStream("REPLAY", len(all)*15, 30*time.Second)
		perDevice(t, replayed, each(all, 15))
		perDevice(t, live, each(devs, 15))

		prefix := "replay:" + l.ID + ":"
		got := byID(t, replayed, prefix)
		want := byID(t, append(live, dead...), "")
		if len(got) != len(want) {
			t.Fatalf("REPLAY holds %d messages, OUTGOING and UNMAPPED %d", len(got), len(want))
		}
		for _, id := range slices.Sorted(maps.Keys(want)) {
			w, g := want[id], got[id]
			if g == nil {
				t.Fatalf("%s is in %s but not in REPLAY", id, w.Subject())
			}
			wantSubject := strings.NewReplacer("outgoing.", "replay.", "unmapped.", "replay-unmapped.").Replace(w.Subject())
			if g.Subject() != wantSubject || string(g.Data()) != string(w.Data()) {
				t.Fatalf("%s: replayed %s %q, live %s %q", id, g.Subject(), g.Data(), w.Subject(), w.Data())
			}
			wh, gh := w.Headers(), g.Headers()
			if gh.Get(wire.HeaderReplay) != l.ID {
				t.Errorf("%s: %s %q, want %q", id, wire.HeaderReplay, gh.Get(wire.HeaderReplay), l.ID)
			}
			// The same partition and revision; a replay holds no lease, so no epoch.
			wp, _ := wire.ReadProvenance(wh.Get)
			gp, _ := wire.ReadProvenance(gh.Get)
			if gp.Partition != wp.Partition || gp.Revision != wp.Revision || gp.Epoch != 0 {
				t.Errorf("%s: replayed %s %q, live %q: want the same partition and revision, and no epoch", id, wire.HeaderProvenance, gh.Get(wire.HeaderProvenance), wh.Get(wire.HeaderProvenance))
			}
			for _, h := range []nats.Header{wh, gh} {
				h.Del(nats.MsgIdHdr)
				h.Del(wire.HeaderReplay)
				h.Del(wire.HeaderProvenance)
			}
			if fmt.Sprint(wh) != fmt.Sprint(gh) {
				t.Fatalf("%s: replayed headers %v, live %v (but Nats-Msg-Id, provenance and replay id)", id, gh, wh)
			}
		}
	})
}

// A replay process killed with kill -9 mid-way and run again stores nothing twice and misses
// nothing, after the target's duplicate window has passed.
func TestReplayKilledAndResumed(t *testing.T) {
	e := newEnv(t)
	devs := deviceNames("dev-", 8)
	for _, d := range devs {
		e.put(d, "g")
	}
	newLoad(t, e.js).publish(devs, 800) // 6400 messages
	if _, err := e.js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "REPLAY",
		Subjects: []string{"replay.>", "replay-unmapped.>", "probe"}, Duplicates: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"replay"}, e.flags()...)
	args = append(args, "--from-seq", "1", "--into", "REPLAY", "--log-format", "json")
	p := startProcess(t, "replay", append(args, "--max-rate", "2000")...)
	var id string
	natstest.Eventually(t, 30*time.Second, func() error {
		for _, l := range p.logs.lines() {
			if done, ok := l["done"].(float64); ok && done >= 1000 {
				id = l["id"].(string)
				return nil
			}
		}
		select {
		case <-p.done:
			return fmt.Errorf("replay exited (%v) before it got far:\n%s", p.err, p.logs.tail(20))
		default:
		}
		return fmt.Errorf("replay has not reported 1000 done")
	})
	p.kill()
	n := e.count("REPLAY")
	if n == 0 || n >= 6400 {
		t.Fatalf("REPLAY holds %d messages after the kill, want some but not all", n)
	}
	e.waitDuplicateWindow("REPLAY", "probe")

	out, errOut, code := runCLI(t, args...)
	if code != 0 {
		t.Fatalf("resumed replay: exit %d: %s", code, errOut)
	}
	l := lastReplayLine(t, out)
	if l.ID != id || !l.Resumed || !l.Complete {
		t.Fatalf("resumed replay's last line: %+v, want id %s, resumed, complete", l, id)
	}
	msgs := e.readStream("REPLAY", 6400, 30*time.Second)
	perDevice(t, msgs, each(devs, 800))
	if got := len(byID(t, msgs, "replay:"+id+":")); got != 6400 {
		t.Fatalf("REPLAY holds %d messages, want 6400", got)
	}
	t.Logf("killed with %d stored; the resumed run found %d stored beyond its progress record and mapped %d", n, l.AlreadyStored, l.Mapped)
}

// waitDuplicateWindow returns once stream no longer recognises as a duplicate a Nats-Msg-Id it
// stored after everything it holds now: the duplicate window has passed for all of it. The probes
// (on subject, which stream must capture) are purged.
func (e *env) waitDuplicateWindow(stream, subject string) {
	e.t.Helper()
	ctx := context.Background()
	if _, err := e.js.Publish(ctx, subject, nil, jetstream.WithMsgID("probe")); err != nil {
		e.t.Fatal(err)
	}
	natstest.Eventually(e.t, 30*time.Second, func() error {
		ack, err := e.js.Publish(ctx, subject, nil, jetstream.WithMsgID("probe"))
		if err != nil {
			return err
		}
		if ack.Duplicate {
			return fmt.Errorf("%s still recognises the probe's id", stream)
		}
		return nil
	})
	s, err := e.js.Stream(ctx, stream)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := s.Purge(ctx, jetstream.WithPurgeSubject(subject)); err != nil {
		e.t.Fatal(err)
	}
}

// The command line refuses OUTGOING without the confirmation, a missing --into with a usage
// error, and a dry run prints counts per group and stores nothing.
func TestReplayCommandLine(t *testing.T) {
	e := newEnv(t)
	e.put("a", "g1")
	newLoad(t, e.js).publish([]string{"a", "b"}, 3)
	_, errOut, code := e.cli("replay", "--from-seq", "1", "--into", "OUTGOING", "--log-format", "json")
	if code != 1 || !strings.Contains(errOut, "--yes-into-outgoing") {
		t.Errorf("replay --into OUTGOING: exit %d, stderr %q; want 1 naming --yes-into-outgoing", code, errOut)
	}
	if _, _, code := e.cli("replay", "--from-seq", "1"); code != 2 {
		t.Errorf("replay without --into: exit %d, want 2", code)
	}
	out, errOut, code := e.cli("replay", "--from-seq", "1", "--into", "REPLAY", "--dry-run", "--log-format", "json")
	if code != 0 {
		t.Fatalf("replay --dry-run: exit %d: %s", code, errOut)
	}
	if l := lastReplayLine(t, out); l.Groups["g1"] != 3 || !l.Complete {
		t.Errorf("dry run's last line %+v, want g1: 3", l)
	}
	if _, err := e.js.Stream(context.Background(), "REPLAY"); err == nil {
		t.Error("a dry run created REPLAY")
	}
}
