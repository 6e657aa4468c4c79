package lanes_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func TestMain(m *testing.M) {
	flag.Parse()
	natstest.SetParallel(natstest.WaitingTests)
	goleak.VerifyTestMain(m)
}

func TestHeadersAndPayloadArriveUnchanged(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		f.groups.set("dev-42", "group-a")
		pool, _ := f.run(lanes.Config{}, nil)

		hdr := nats.Header{}
		hdr.Set("Nats-Expected-Stream", f.stream("dev-42"))
		hdr.Set("Nats-Msg-Id", "device-own-id")
		hdr.Set("X-Trace", "abc")
		hdr.Add("X-Multi", "one")
		hdr.Add("X-Multi", "two")
		// A device cannot pass provenance off, in either spelling.
		hdr.Set(wire.HeaderProvenance, "1.2.3")
		hdr.Set(wire.HeaderEpoch, "999")
		payload := []byte("\x00binary\xffpayload with spaces\n")
		if _, err := f.js.PublishMsg(context.Background(), &nats.Msg{Subject: "incoming.dev-42.temp", Header: hdr, Data: payload}); err != nil {
			t.Fatal(err)
		}
		m := f.read("OUTGOING", 1)[0]
		if got, want := m.Subject(), "outgoing.group-a.dev-42.temp"; got != want {
			t.Errorf("Subject()=%q, want %q", got, want)
		}
		if string(m.Data()) != string(payload) {
			t.Errorf("Data()=%q, want %q", m.Data(), payload)
		}
		h := m.Headers()
		p := subjects.Partition("dev-42", 16)
		for k, want := range map[string][]string{
			"X-Trace":               {"abc"},
			"X-Multi":               {"one", "two"},
			"Nats-Msg-Id":           {f.msgID("dev-42", 1)},
			wire.HeaderOrigMsgID:    {"device-own-id"},
			wire.HeaderProvenance:   {fmt.Sprintf("%d.%d.7", p, 100+p)},
			wire.HeaderPartition:    nil,
			wire.HeaderEpoch:        nil,
			wire.HeaderRevision:     nil,
			"Nats-Expected-Stream":  nil,
			"Nats-Expected-Last-Sq": nil,
		} {
			if got := h.Values(k); !slices.Equal(got, want) {
				t.Errorf("header %s = %q, want %q", k, got, want)
			}
		}
		for k := range h {
			if strings.HasPrefix(strings.ToLower(k), "nats-expected-") {
				t.Errorf("header %s survived; Nats-Expected-* addressed INCOMING", k)
			}
		}
		natstest.Eventually(t, 5*time.Second, func() error {
			if got := f.checkpoint(p); got != 1 {
				return fmt.Errorf("checkpoint.%d = %d, want 1", p, got)
			}
			return nil
		})
		if st := pool.Stats(); st.Mapped != 1 || st.Duplicates != 0 {
			t.Errorf("Stats() = %+v, want 1 mapped, 0 duplicates", st)
		}
		// The lane learns that its checkpoint is written from the put's answer, which may come
		// after the bucket shows the value to the test's read.
		natstest.Eventually(t, 5*time.Second, func() error {
			parts := pool.Partitions()
			if len(parts) != 16 {
				return fmt.Errorf("Partitions() has %d lanes, want 16", len(parts))
			}
			if got := parts[p]; got.Partition != p || got.Acked != 1 || got.Checkpoint != 1 || got.Lag() != 0 || got.Epoch != uint64(100+p) {
				return fmt.Errorf("Partitions()[%d] = %+v, want acked and checkpointed 1, lag 0", p, got)
			}
			return nil
		})
	})
}

func TestNoProvenance(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.groups.set("dev-1", "g")
	f.run(lanes.Config{NoProvenance: true}, nil)
	f.publish([]string{"dev-1"}, 1, nil)
	h := f.read("OUTGOING", 1)[0].Headers()
	for _, k := range []string{wire.HeaderProvenance, wire.HeaderPartition, wire.HeaderEpoch, wire.HeaderRevision} {
		if v := h.Get(k); v != "" {
			t.Errorf("header %s = %q with NoProvenance", k, v)
		}
	}
}

func TestOrderAcrossManyDevices(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		devs := devices(200)
		for i, d := range devs {
			f.groups.set(d, "g"+strconv.Itoa(i%5))
		}
		group := func(d string) string {
			i, _ := strconv.Atoi(strings.TrimPrefix(d, "dev-"))
			return "g" + strconv.Itoa(i%5)
		}
		// A small window makes lanes wait for room (TestInFlightBoundOnTheWire checks the bound).
		pool, stop := f.run(lanes.Config{MaxInFlight: 64}, nil)
		f.publish(devs, 100, nil)
		checkOrder(t, f.read("OUTGOING", 20_000), devs, 100, func(d string) string { return "outgoing." + group(d) + "." + d + ".evt" })
		f.checkReaders()
		for p, err := range stop() {
			if err != nil {
				t.Errorf("Run(partition %d) = %v, want nil", p, err)
			}
		}
		if st := pool.Stats(); st.Mapped != 20_000 || st.Duplicates != 0 {
			t.Errorf("Stats() = %+v, want 20000 mapped, 0 duplicates", st)
		}
		// The final checkpoints cover every message: a restart would resend nothing.
		for p := range 16 {
			if got, want := f.checkpoint(p), f.lastSeq(p); got != want {
				t.Errorf("checkpoint.%d = %d, want %d, the partition's last sequence", p, got, want)
			}
		}
	})
}

func TestUnmappedGoToDeadLetters(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.groups.set("good", "g")
	bad := map[string]string{
		"dot":   "a.b",
		"star":  "*",
		"gt":    ">",
		"empty": "",
		"long":  strings.Repeat("x", 300),
		"space": "has space",
	}
	for d, v := range bad {
		f.groups.set(d, v)
	}
	pool, _ := f.run(lanes.Config{}, nil)
	devs := []string{"good", "nokey"}
	for d := range bad {
		devs = append(devs, d)
	}
	f.publish(devs, 3, nil)
	unmapped := f.read("UNMAPPED", 3*(len(devs)-1))
	for _, m := range unmapped {
		dev, _, _ := strings.Cut(string(m.Data()), ":")
		want := wire.ReasonInvalidGroup
		if dev == "nokey" {
			want = wire.ReasonNoMapping
		}
		if got := m.Headers().Get(wire.HeaderReason); got != want {
			t.Errorf("device %s: %s=%q, want %q", dev, wire.HeaderReason, got, want)
		}
		if got := m.Subject(); got != "unmapped."+dev+".evt" {
			t.Errorf("device %s: subject %q", dev, got)
		}
	}
	checkOrder(t, unmapped, devs[1:], 3, func(d string) string { return "unmapped." + d + ".evt" })
	checkOrder(t, f.read("OUTGOING", 3), []string{"good"}, 3, func(d string) string { return "outgoing.g.good.evt" })

	// The lanes keep running: a device fixed in the table maps again.
	f.groups.set("dot", "fixed")
	if _, err := f.js.Publish(context.Background(), "incoming.dot.evt", []byte("dot:3")); err != nil {
		t.Fatal(err)
	}
	if got := f.read("OUTGOING", 4)[3].Subject(); got != "outgoing.fixed.dot.evt" {
		t.Errorf("after the fix: subject %q, want outgoing.fixed.dot.evt", got)
	}
	st := pool.Stats()
	if st.Unmapped[wire.ReasonNoMapping] != 3 || st.Unmapped[wire.ReasonInvalidGroup] != 18 {
		t.Errorf("Stats().Unmapped = %v, want 3 no-mapping, 18 invalid-group", st.Unmapped)
	}
}

func TestMalformedSubjectIsDeadLettered(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		f.groups.set("dev-1", "g")
		ctx := context.Background()
		if f.names.StreamLayout == subjects.SingleStream {
			s, err := f.js.Stream(ctx, "INCOMING")
			if err != nil {
				t.Fatal(err)
			}
			cfg := s.CachedInfo().Config
			// A subject someone added to INCOMING by hand, stored untransformed under partition 7.
			// (INCOMING-7 of the partition-streams layout captures it as it is.)
			cfg.Subjects = append(cfg.Subjects, "incoming.7.too.many.tokens")
			if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
				t.Fatal(err)
			}
		}
		f.run(lanes.Config{}, nil)
		if _, err := f.js.Publish(ctx, "incoming.7.too.many.tokens", []byte("odd")); err != nil {
			t.Fatal(err)
		}
		f.publish([]string{"dev-1"}, 1, nil)
		m := f.read("UNMAPPED", 1)[0]
		if m.Subject() != f.lay.MalformedSubject() || string(m.Data()) != "odd" {
			t.Errorf("dead letter %q %q, want %q \"odd\"", m.Subject(), m.Data(), f.lay.MalformedSubject())
		}
		if got := m.Headers().Get(wire.HeaderReason); got != wire.ReasonMalformedSubject {
			t.Errorf("reason %q, want %q", got, wire.ReasonMalformedSubject)
		}
		if got := m.Headers().Get(wire.HeaderSubject); got != "incoming.7.too.many.tokens" {
			t.Errorf("%s = %q", wire.HeaderSubject, got)
		}
		if m.Headers().Get(wire.HeaderError) == "" {
			t.Errorf("no %s header saying what is wrong", wire.HeaderError)
		}
		f.read("OUTGOING", 1)
	})
}

func TestOversizedIsDeadLetteredAndOrderKept(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		f.groups.set("dev-1", "g")
		ctx := context.Background()
		s, err := f.js.Stream(ctx, "OUTGOING")
		if err != nil {
			t.Fatal(err)
		}
		cfg := s.CachedInfo().Config
		cfg.MaxMsgSize = 512
		if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		pool, _ := f.run(lanes.Config{}, nil)
		for i, size := range []int{10, 2000, 10} {
			data := []byte(fmt.Sprintf("dev-1:%d:%s", i, strings.Repeat("x", size)))
			if _, err := f.js.Publish(ctx, "incoming.dev-1.evt", data); err != nil {
				t.Fatal(err)
			}
		}
		out := f.read("OUTGOING", 2)
		for i, want := range []string{"dev-1:0:", "dev-1:2:"} {
			if !strings.HasPrefix(string(out[i].Data()), want) {
				t.Errorf("OUTGOING[%d] = %.20q…, want prefix %q", i, out[i].Data(), want)
			}
		}
		dl := f.read("UNMAPPED", 1)[0]
		h := dl.Headers()
		if h.Get(wire.HeaderReason) != wire.ReasonOversized || h.Get("Nats-Msg-Id") != f.msgID("dev-1", 2) || h.Get(wire.HeaderError) == "" {
			t.Errorf("dead letter headers %v, want reason oversized, Nats-Msg-Id %s and the server's error", h, f.msgID("dev-1", 2))
		}
		if dl.Subject() != "unmapped.dev-1.evt" {
			t.Errorf("dead letter subject %q", dl.Subject())
		}
		if st := pool.Stats(); st.Unmapped[wire.ReasonOversized] != 1 {
			t.Errorf("Stats().Unmapped = %v, want 1 oversized", st.Unmapped)
		}
	})
}

// A header OUTGOING refuses a message for sends it to UNMAPPED as rejected, and the partition goes
// on: a per-message TTL OUTGOING does not allow (400, err_code 10166). A header that would make
// OUTGOING act on other messages is not passed on at all (wire.ActsOnStream): OUTGOING allows
// rollups here, as setup makes a replicated one for its fence records, and a device's
// Nats-Rollup: all would have wiped it. INCOMING allows both here, as a stream of the user's own
// may.
func TestRefusedHeadersAreRejected(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		f.groups.set("dev-1", "g")
		ctx := context.Background()
		in, err := f.js.Stream(ctx, f.stream("dev-1"))
		if err != nil {
			t.Fatal(err)
		}
		cfg := in.CachedInfo().Config
		cfg.AllowMsgTTL, cfg.AllowRollup = true, true
		if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		f.fenceStream(f.names.Outgoing)
		pool, _ := f.run(lanes.Config{RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond}, nil)
		publish := func(i int, m *nats.Msg) {
			t.Helper()
			m.Data = fmt.Appendf(nil, "dev-1:%d", i)
			if _, err := f.js.PublishMsg(ctx, m); err != nil {
				t.Fatalf("PublishMsg(%s): %v", m.Subject, err)
			}
		}
		publish(0, &nats.Msg{Subject: "incoming.dev-1.evt"})
		publish(1, &nats.Msg{Subject: "incoming.dev-1.ttl", Header: nats.Header{"Nats-TTL": {"1m"}}})
		publish(2, &nats.Msg{Subject: "incoming.dev-1.roll"})
		f.read("OUTGOING", 2)
		// INCOMING rolls its own copy of 2 up; OUTGOING, which stored 2 already, must not.
		publish(3, &nats.Msg{Subject: "incoming.dev-1.roll", Header: nats.Header{"Nats-Rollup": {"sub"}}})
		publish(4, &nats.Msg{Subject: "incoming.dev-1.evt"})
		f.waitOrDump(pool, "OUTGOING", 4, 15*time.Second)
		dl := f.read("UNMAPPED", 1)[0]
		if h := dl.Headers(); h.Get(wire.HeaderReason) != wire.ReasonRejected || h.Get("Nats-Msg-Id") != f.msgID("dev-1", 2) || h.Get(wire.HeaderError) == "" {
			t.Errorf("dead letter: headers %v, want reason rejected, Nats-Msg-Id %s and the server's error", h, f.msgID("dev-1", 2))
		}
		out := f.read("OUTGOING", 4)
		for i, want := range []string{"dev-1:0", "dev-1:2", "dev-1:3", "dev-1:4"} {
			if string(out[i].Data()) != want {
				t.Errorf("OUTGOING[%d] = %q, want %q", i, out[i].Data(), want)
			}
		}
		if h := out[2].Headers(); h.Get("Nats-Rollup") != "" {
			t.Errorf("OUTGOING stored the device's rollup with headers %v, want Nats-Rollup left out", h)
		}
		if st := pool.Stats(); st.Unmapped[wire.ReasonRejected] != 1 {
			t.Errorf("Stats().Unmapped = %v, want 1 rejected", st.Unmapped)
		}
	})
}

func TestStopAndRestartResumesFromCheckpoint(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		devs := devices(50)
		for _, d := range devs {
			f.groups.set(d, "g")
		}
		pool1, stop1 := f.run(lanes.Config{}, nil)
		f.publish(devs, 40, nil)
		f.atLeast("OUTGOING", 1000) // some progress, not necessarily all
		for p, err := range stop1() {
			if err != nil {
				t.Fatalf("Run(%d) = %v", p, err)
			}
		}
		f.publishFrom(devs, 40, 40, nil)
		pool2, _ := f.run(lanes.Config{}, nil)
		checkOrder(t, f.read("OUTGOING", 4000), devs, 80, func(d string) string { return "outgoing.g." + d + ".evt" })
		if d1, d2 := pool1.Stats().Duplicates, pool2.Stats().Duplicates; d1+d2 != 0 {
			t.Errorf("duplicates sent: %d then %d, want none: the graceful stop checkpoints everything acknowledged", d1, d2)
		}
		if got := pool1.Stats().Mapped + pool2.Stats().Mapped; got != 4000 {
			t.Errorf("mapped %d in all, want 4000", got)
		}
	})
}

// A message resent for a partition (a takeover from an old checkpoint, here a lost one) is
// acknowledged by OUTGOING as a duplicate, and counted as one.
func TestResentMessagesCountAsDuplicates(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		dev := "dev-1"
		p := subjects.Partition(dev, 16)
		f.groups.set(dev, "g")
		pool1, stop1 := f.run(lanes.Config{}, nil)
		f.publish([]string{dev}, 5, nil)
		f.read("OUTGOING", 5)
		stop1()
		if st := pool1.Stats(); st.Mapped != 5 || st.Duplicates != 0 {
			t.Fatalf("first run: Stats() = %+v, want 5 mapped", st)
		}
		if err := f.ctl.Delete(context.Background(), wire.CheckpointKey(p)); err != nil {
			t.Fatal(err)
		}
		pool2, _ := f.run(lanes.Config{}, nil)
		natstest.Eventually(t, 10*time.Second, func() error {
			if st := pool2.Stats(); st.Duplicates+st.Mapped != 5 {
				return fmt.Errorf("second run: Stats() = %+v, want 5 acknowledged", st)
			}
			return nil
		})
		if st := pool2.Stats(); st.Duplicates != 5 {
			t.Errorf("second run: Stats() = %+v, want 5 duplicates", st)
		}
		checkOrder(t, f.read("OUTGOING", 5), []string{dev}, 5, func(string) string { return "outgoing.g.dev-1.evt" })
	})
}

func TestServerRestartKeepsOrder(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	eachLayout(t, func(t *testing.T, f *fixture) {
		devs := devices(100)
		for _, d := range devs {
			f.groups.set(d, "g")
		}
		// A round stores a backlog of 15,000, starts the lanes and restarts the server once 500
		// of it are in OUTGOING (counted, not read, so that the restart comes as soon as it can).
		// From that moment the lanes' publishes to OUTGOING vanish on the way (natstest.Dropper)
		// until the restart: a server shutting down gracefully answers all it has read, and a
		// restart alone often hit no publish in flight. Up to three rounds, until one hits
		// publishes in flight.
		const rounds, per = 3, 150
		var failures uint64
		round := 0
		for ; round < rounds && failures == 0; round++ {
			f.publishFrom(devs, round*per, per, nil)
			pool, drop := f.droppingPool(lanes.Config{})
			pool, stop := f.runPool(pool, nil)
			f.waitOrDump(pool, "OUTGOING", uint64(round*per*len(devs)+500), time.Minute)
			drop.Drop("outgoing.")
			f.restart()
			drop.Drop("")
			natstest.Eventually(t, 10*time.Second, func() error {
				if !f.nc.IsConnected() {
					return errors.New("test connection not reconnected")
				}
				return nil
			})
			// Generous: on a loaded 2-core machine a restart can make acknowledgements time
			// out and the lanes resend their whole window, which is slow but must not lose or
			// reorder anything.
			f.waitOrDump(pool, "OUTGOING", uint64((round+1)*per*len(devs)), 3*time.Minute)
			st := pool.Stats()
			stop()
			t.Logf("round %d, after a server restart: %+v", round, st)
			failures += st.Failures
		}
		n := round * per
		checkOrder(t, f.read("OUTGOING", n*len(devs)), devs, n, func(d string) string { return "outgoing.g." + d + ".evt" })
		if failures == 0 {
			t.Errorf("%d server restarts hit no publish in flight, so this test proved nothing", round)
		}
	})
}

func TestOutgoingDeletedPausesAndResumes(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.groups.set("dev-1", "g")
	pool, _ := f.run(lanes.Config{MaxRetryBackoff: 100 * time.Millisecond}, nil)
	ctx := context.Background()
	if err := f.js.DeleteStream(ctx, "OUTGOING"); err != nil {
		t.Fatal(err)
	}
	f.publish([]string{"dev-1"}, 20, nil)
	natstest.Eventually(t, 10*time.Second, func() error {
		if pool.Stats().Failures == 0 {
			return errors.New("no publish failure yet")
		}
		return nil
	})
	if _, err := setup.Ensure(ctx, f.js, setup.Config{Layout: f.lay}); err != nil {
		t.Fatal(err)
	}
	checkOrder(t, f.read("OUTGOING", 20), []string{"dev-1"}, 20, func(string) string { return "outgoing.g.dev-1.evt" })
}

func TestInvalidConfig(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	for name, cfg := range map[string]lanes.Config{
		"no layout":                        {},
		"negative window":                  {Layout: f.lay, MaxInFlight: -1},
		"window too large":                 {Layout: f.lay, MaxInFlight: 100_000},
		"window below the partition count": {Layout: f.lay, MaxInFlight: 15},
		"negative bytes":                   {Layout: f.lay, MaxInFlightBytes: -1},
		"unknown stream layout":            {Layout: f.lay, StreamLayout: "sharded"},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg); !errors.Is(err, lanes.ErrInvalidConfig) {
				t.Errorf("New() error = %v, want ErrInvalidConfig", err)
			}
		})
	}
	pool, err := lanes.New(f.js, f.ctl, f.groups.lookup, lanes.Config{Layout: f.lay})
	if err != nil {
		t.Fatal(err)
	}
	if err := pool.Run(context.Background(), lanes.Assignment{Partition: 16}); !errors.Is(err, lanes.ErrInvalidConfig) {
		t.Errorf("Run(partition 16 of 16) = %v, want ErrInvalidConfig", err)
	}
}

var _ = jetstream.ErrKeyExists
