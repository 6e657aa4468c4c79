package replay_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/replay"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// A replay goes only where it is told: never into INCOMING, the live dead letters or a subject
// another stream captures; into OUTGOING only when confirmed, its dead letters then into UNMAPPED.
func TestWhereAReplayMayGo(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	f.put("dev", "g")
	f.publish([]string{"dev", "nomap"}, 3)
	live := f.layout("outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}")
	for _, c := range []struct {
		name string
		mod  func(*replay.Config)
		want string // in the error
	}{
		{"OUTGOING unconfirmed", func(c *replay.Config) { c.Into, c.Layout = "OUTGOING", live }, "--yes-into-outgoing"},
		{"INCOMING", func(c *replay.Config) { c.Into = "INCOMING" }, "would loop"},
		{"UNMAPPED", func(c *replay.Config) { c.Into = "UNMAPPED" }, "dead-letter stream"},
		{"a bucket", func(c *replay.Config) { c.Into = "KV_device-groups" }, "bucket"},
		{"OUTGOING's subjects", func(c *replay.Config) { c.Layout = f.layout("outgoing.{group}.{device}.{event}", replayDead) }, "OUTGOING captures"},
		{"missing, not created", func(c *replay.Config) { c.Create = false }, "does not exist"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := f.config()
			c.mod(&cfg)
			_, err := f.run(cfg)
			if !errors.Is(err, replay.ErrTarget) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Run = %v, want ErrTarget saying %q", err, c.want)
			}
		})
	}
	ctx := context.Background()
	if _, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: "OTHER", Subjects: []string{"other.>"}}); err != nil {
		t.Fatal(err)
	}
	cfg := f.config()
	cfg.Into, cfg.Create = "OTHER", false
	if _, err := f.run(cfg); !errors.Is(err, replay.ErrTarget) || !strings.Contains(err.Error(), "not every subject") {
		t.Errorf("Run into a stream that does not capture the out template = %v, want ErrTarget", err)
	}
	cfg.Layout = f.layout("other.{group}.{device}.{event}", "other-unmapped.{device}.{event}")
	if _, err := f.run(cfg); !errors.Is(err, replay.ErrTarget) || !strings.Contains(err.Error(), "dead letters") {
		t.Errorf("Run with dead letters no stream captures = %v, want ErrTarget", err)
	}

	cfg = f.config()
	cfg.Into, cfg.Layout, cfg.IntoOutgoing = "OUTGOING", live, true
	s := f.mustRun(cfg)
	if s.DeadLetters != "UNMAPPED" || s.Mapped != 3 || s.Reasons[wire.ReasonNoMapping] != 3 {
		t.Errorf("into OUTGOING: dead letters to %s, mapped %d, unmapped %v; want UNMAPPED, 3, no-mapping: 3", s.DeadLetters, s.Mapped, s.Reasons)
	}
	if got := perDevice(t, f.read("UNMAPPED"))["nomap"]; len(got) != 3 || got[0] != "unmapped.nomap.evt" {
		t.Errorf("UNMAPPED holds nomap's messages on %v, want 3 on unmapped.nomap.evt", got)
	}
}

// Bad input is dead-lettered as the live mapper does: a stored subject that does not fit the in
// template, a message the target refuses for its size (kept in order with the device's others).
func TestBadInputIsDeadLettered(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	ctx := context.Background()
	s, err := f.js.Stream(ctx, "INCOMING")
	if err != nil {
		t.Fatal(err)
	}
	ic := s.CachedInfo().Config
	ic.Subjects = append(ic.Subjects, "incoming.7.too.many.tokens") // added by hand, stored as is
	if _, err := f.js.UpdateStream(ctx, ic); err != nil {
		t.Fatal(err)
	}
	f.put("dev", "g")
	f.publish([]string{"dev"}, 1)
	if _, err := f.js.Publish(ctx, "incoming.7.too.many.tokens", []byte("odd")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.js.Publish(ctx, "incoming.dev.evt", []byte("dev:1:"+strings.Repeat("x", 2000))); err != nil {
		t.Fatal(err)
	}
	f.next["dev"]++
	f.publish([]string{"dev"}, 1)
	f.createReplayStream(func(c *jetstream.StreamConfig) { c.MaxMsgSize, c.Duplicates = 1024, time.Minute })

	cfg := f.config()
	cfg.Create = false
	sum := f.mustRun(cfg)
	if sum.Reasons[wire.ReasonMalformedSubject] != 1 || sum.Reasons[wire.ReasonOversized] != 1 || sum.Mapped != 2 {
		t.Errorf("summary: unmapped %v, mapped %d; want one malformed, one oversized, 2 mapped", sum.Reasons, sum.Mapped)
	}
	msgs := f.read("REPLAY")
	if len(msgs) != 4 {
		t.Fatalf("REPLAY holds %d messages, want 4", len(msgs))
	}
	odd := msgs[1]
	if odd.Subject() != "replay-unmapped._malformed._malformed" || string(odd.Data()) != "odd" ||
		odd.Headers().Get(wire.HeaderReason) != wire.ReasonMalformedSubject || odd.Headers().Get(wire.HeaderSubject) != "incoming.7.too.many.tokens" ||
		odd.Headers().Get(wire.HeaderError) == "" {
		t.Errorf("malformed dead letter: %s %q %v", odd.Subject(), odd.Data(), odd.Headers())
	}
	big := msgs[2]
	if big.Subject() != "replay-unmapped.dev.evt" || len(big.Data()) != 0 || big.Headers().Get(wire.HeaderReason) != wire.ReasonOversized {
		t.Errorf("oversized dead letter: %s, %d bytes, reason %q; want replay-unmapped.dev.evt, no payload, %s",
			big.Subject(), len(big.Data()), big.Headers().Get(wire.HeaderReason), wire.ReasonOversized)
	}
	if string(msgs[0].Data()) != "dev:0" || string(msgs[3].Data()) != "dev:2" {
		t.Errorf("dev's messages around the dead letters: %q, %q; want dev:0, dev:2", msgs[0].Data(), msgs[3].Data())
	}
}

// A dry run publishes and records nothing, and counts what would go where.
func TestDryRun(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	f.put("a", "g1")
	f.put("b", "g2")
	f.publish([]string{"a", "b", "c"}, 4)
	cfg := f.config()
	cfg.DryRun = true
	s := f.mustRun(cfg)
	if s.Groups["g1"] != 4 || s.Groups["g2"] != 4 || s.Reasons[wire.ReasonNoMapping] != 4 || s.Mapped != 8 || !s.DryRun {
		t.Errorf("dry run: groups %v, unmapped %v, mapped %d; want g1 4, g2 4, no-mapping 4, 8", s.Groups, s.Reasons, s.Mapped)
	}
	if _, err := f.js.Stream(context.Background(), "REPLAY"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("a dry run created REPLAY (%v)", err)
	}
	if _, err := f.ctl.Get(context.Background(), wire.ReplayKey(s.ID)); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("a dry run wrote its progress record (%v)", err)
	}
}

// A sequence range of one partition replays exactly that partition's messages in it; a
// device filter only that device's.
func TestRangesPartitionsAndDevices(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	devs := devices("d", 8)
	for _, d := range devs {
		f.put(d, "g")
	}
	f.publish(devs, 10) // 1..80, device i at 8k+i+1
	in := f.incoming()
	p := subjects.Partition("d03", 16)
	cfg := f.config()
	cfg.FromTime, cfg.FromSeq, cfg.ToSeq, cfg.Partitions = time.Time{}, 20, 60, []int{p}
	s := f.mustRun(cfg)
	want := 0
	for payload, src := range in {
		dev, _, _ := strings.Cut(payload, ":")
		_, n, _ := strings.Cut(src, ":")
		seq, err := strconv.Atoi(n)
		if err != nil {
			t.Fatal(err)
		}
		if subjects.Partition(dev, 16) == p && seq >= 20 && seq <= 60 {
			want++
		}
	}
	if got := len(f.read("REPLAY")); got != want || int(s.Mapped) != want || want == 0 {
		t.Errorf("partition %d, sequences 20..60: REPLAY holds %d, mapped %d; want %d", p, got, s.Mapped, want)
	}

	cfg = f.config()
	cfg.Into, cfg.Devices = "ONE", []string{"d05"}
	cfg.Layout = f.layout("one.{group}.{device}.{event}", "one-unmapped.{device}.{event}")
	s = f.mustRun(cfg)
	subs := perDevice(t, f.read("ONE"))
	if len(subs) != 1 || len(subs["d05"]) != 10 || s.Mapped != 10 {
		t.Errorf("devices d05: REPLAY holds %d devices, %d of d05, mapped %d; want 1, 10, 10", len(subs), len(subs["d05"]), s.Mapped)
	}
}

// New refuses what cannot be replayed, saying why.
func TestNewRefusesBadConfig(t *testing.T) {
	lay, err := subjects.NewLayout("incoming.{device}.{event}", replayOut, replayDead, 16)
	if err != nil {
		t.Fatal(err)
	}
	streams := subjects.Names{StreamLayout: subjects.PartitionStreams}
	_, js := natstest.Start(t).JetStream(t)
	for _, c := range []struct {
		name string
		cfg  replay.Config
	}{
		{"no start", replay.Config{Layout: lay, Into: "R"}},
		{"no into", replay.Config{Layout: lay, FromSeq: 1}},
		{"seq and time", replay.Config{Layout: lay, Into: "R", FromSeq: 1, FromTime: time.Now()}},
		{"end before start", replay.Config{Layout: lay, Into: "R", FromSeq: 5, ToSeq: 4}},
		{"sequences across partition streams", replay.Config{Layout: lay, Into: "R", FromSeq: 1, Names: streams}},
		{"partition out of range", replay.Config{Layout: lay, Into: "R", FromSeq: 1, Partitions: []int{16}}},
		{"bad id", replay.Config{Layout: lay, Into: "R", FromSeq: 1, ID: "a.b"}},
		{"bad device", replay.Config{Layout: lay, Into: "R", FromSeq: 1, Devices: []string{"a b"}}},
	} {
		if _, err := replay.New(nil, c.cfg); err == nil {
			t.Errorf("%s: New(nil js) = nil error", c.name)
		}
		// With a JetStream context the configuration itself is what New refuses.
		if _, err := replay.New(js, c.cfg); !errors.Is(err, replay.ErrInvalidConfig) {
			t.Errorf("%s: New = %v, want ErrInvalidConfig", c.name, err)
		}
	}
	ok := replay.Config{Layout: lay, Into: "R", FromSeq: 1, Names: streams, Partitions: []int{3}}
	if _, err := replay.New(js, ok); err != nil {
		t.Errorf("sequences of one partition stream: New = %v", err)
	}
}
