package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// parkOn creates PARKED with the limits given (0: setup's defaults) and returns c with parking on.
func (f *fixture) parkOn(c lanes.Config, perDevice, total int64) lanes.Config {
	f.t.Helper()
	cfg := f.setupConfig()
	cfg.Park = &setup.ParkedStream{MaxPerDevice: perDevice, MaxTotal: total}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := setup.Ensure(ctx, f.js, cfg); err != nil {
		f.t.Fatalf("setup.Ensure with Park: %v", err)
	}
	c.Park.Stream, c.Park.New = "PARKED", true
	return c
}

// parked returns how many messages PARKED holds for device.
func (f *fixture) parked(device string) int {
	f.t.Helper()
	n, err := f.tryParked(device)
	if err != nil {
		f.t.Fatal(err)
	}
	return n
}

// tryParked is parked for a poll: just after a server restart a request may time out.
func (f *fixture) tryParked(device string) (int, error) {
	ctx := context.Background()
	s, err := f.js.Stream(ctx, "PARKED")
	if err != nil {
		return 0, fmt.Errorf("reading PARKED: %w", err)
	}
	subj := subjects.ParkedSubject("parked", subjects.Partition(device, f.lay.Partitions), device)
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subj))
	if err != nil {
		return 0, fmt.Errorf("reading PARKED: %w", err)
	}
	return int(info.State.Subjects[subj]), nil
}

// count returns how many messages stream holds.
func (f *fixture) count(stream string) int {
	f.t.Helper()
	n, err := f.tryCount(stream)
	if err != nil {
		f.t.Fatal(err)
	}
	return n
}

// tryCount is count for a poll.
func (f *fixture) tryCount(stream string) (int, error) {
	s, err := f.js.Stream(context.Background(), stream)
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", stream, err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", stream, err)
	}
	return int(info.State.Msgs), nil
}

// waitParked waits until PARKED holds n messages of device.
func (f *fixture) waitParked(device string, n int) {
	f.t.Helper()
	natstest.Eventually(f.t, 30*time.Second, func() error {
		if got, err := f.tryParked(device); err != nil || got != n {
			return fmt.Errorf("PARKED holds %d messages of %s, want %d (%v)", got, device, n, err)
		}
		return nil
	})
}

// sameLane returns n devices of the partition device is in, device first.
func sameLane(device string, n int) []string {
	p := subjects.Partition(device, 16)
	out := []string{device}
	for i := 0; len(out) < n; i++ {
		if d := fmt.Sprintf("other-%03d", i); subjects.Partition(d, 16) == p {
			out = append(out, d)
		}
	}
	return out
}

// The release is held back (its publishes to OUTGOING vanish on the way, natstest.Dropper) while
// the device publishes its next 100, so that every one of them is parked behind the release in
// flight: then the release gets through and the device's 200 land in order.
func TestParkThenReleaseInOrder(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		devs := sameLane("late", 2) // late is provisioned after it published; the other is mapped
		late, mapped := devs[0], devs[1]
		f.groups.set(mapped, "g")
		// A small window: the release and the device's new parks wait for room in turn, so
		// the release catches up while parks are held or in flight.
		cfg := f.parkOn(lanes.Config{MaxInFlight: 16, PublishTimeout: 300 * time.Millisecond}, 0, 0)
		pool, drop := f.droppingPool(cfg)
		f.runPool(pool, nil)

		f.publish(devs, 100, nil)
		f.waitParked(late, 100)
		// The parked device does not hold back the other device of its partition.
		checkOrder(t, f.read("OUTGOING", 100), []string{mapped}, 100, func(d string) string { return "outgoing.g." + d + ".evt" })
		if n := f.count("UNMAPPED"); n != 0 {
			t.Fatalf("UNMAPPED holds %d messages; a parked device's messages must not be dead-lettered", n)
		}

		// Provisioned: released at once, and what it publishes meanwhile stays behind.
		drop.Drop("outgoing.late-group.")
		f.groups.set(late, "late-group")
		pool.Release(late)
		natstest.Eventually(t, 10*time.Second, func() error {
			if drop.Dropped() == 0 {
				return fmt.Errorf("the release has sent nothing yet")
			}
			return nil
		})
		f.publishFrom([]string{late}, 100, 100, nil)
		f.waitParked(late, 200) // parked behind the release, which is still held
		if n := f.count("OUTGOING"); n != 100 {
			t.Fatalf("OUTGOING holds %d messages while the release is held, want the other device's 100", n)
		}
		drop.Drop("")
		out := f.read("OUTGOING", 300)
		checkOrder(t, ofDevice(out, late), []string{late}, 200, func(d string) string { return "outgoing.late-group." + d + ".evt" })
		f.waitParked(late, 0) // released messages are purged
		natstest.Eventually(t, 10*time.Second, func() error {
			st := pool.Stats()
			if st.Parked != 200 || st.Released != 200 || st.Mapped != 300 || st.ParkedDevices != 0 {
				return fmt.Errorf("Stats() = %+v, want 200 parked and released, 300 mapped, no device parked", st)
			}
			return nil
		})
	})
}

// ofDevice returns msgs' messages of device, in order.
func ofDevice(msgs []jetstream.Msg, device string) []jetstream.Msg {
	var out []jetstream.Msg
	for _, m := range msgs {
		if strings.HasPrefix(string(m.Data()), device+":") {
			out = append(out, m)
		}
	}
	return out
}

// A restart of the server and the pool keeps what is parked, and the new pool parks the device
// again from PARKED alone: mapped before the new pool starts, its next messages must still go
// behind the parked ones.
func TestParkedSurviveRestart(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, f *fixture) {
		cfg := f.parkOn(lanes.Config{}, 0, 0)
		_, stop := f.run(cfg, nil)
		f.publish([]string{"late"}, 100, nil)
		f.waitParked("late", 100)
		stop()
		f.restart()
		natstest.Eventually(t, 10*time.Second, func() error {
			if !f.nc.IsConnected() {
				return fmt.Errorf("test connection not reconnected")
			}
			return nil
		})
		f.waitParked("late", 100)

		f.groups.set("late", "g")
		f.publishFrom([]string{"late"}, 100, 100, nil)
		pool, _ := f.run(cfg, nil) // no Release call: the sweep finds the group
		checkOrder(t, f.read("OUTGOING", 200), []string{"late"}, 200, func(d string) string { return "outgoing.g." + d + ".evt" })
		f.waitParked("late", 0)
		if st := pool.Stats(); st.Released == 0 || st.Duplicates != 0 {
			t.Errorf("Stats() = %+v, want messages released, no duplicates", st)
		}
	})
}

// PARKED's limits end in UNMAPPED as park-full, with the server's words; what was parked is
// released in order.
func TestParkLimits(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.parkOn(lanes.Config{}, 10, 25)
	pool, _ := f.run(cfg, nil)
	f.publish([]string{"a"}, 15, nil) // 10 parked, 5 over the device's limit
	f.waitParked("a", 10)
	f.publish([]string{"b", "c"}, 10, nil) // 15 more fit in all, whichever come first
	natstest.Eventually(t, 20*time.Second, func() error {
		if n, err := f.tryCount("UNMAPPED"); err != nil || n != 10 {
			return fmt.Errorf("UNMAPPED holds %d messages, want 10 (%v)", n, err)
		}
		return nil
	})
	dead := f.read("UNMAPPED", 10)
	byDev := map[string][]string{}
	for _, m := range dead {
		dev, _, _ := strings.Cut(string(m.Data()), ":")
		if got := m.Headers().Get(wire.HeaderReason); got != wire.ReasonParkFull {
			t.Fatalf("dead letter %q: reason %q, want %q", m.Data(), got, wire.ReasonParkFull)
		}
		byDev[dev] = append(byDev[dev], m.Headers().Get(wire.HeaderError))
	}
	if len(byDev["a"]) != 5 || !strings.Contains(byDev["a"][0], "per subject") {
		t.Errorf("device a's dead letters: %q; want 5 saying the per-device limit was hit", byDev["a"])
	}
	if n := len(byDev["b"]) + len(byDev["c"]); n != 5 || !strings.Contains(append(byDev["b"], byDev["c"]...)[0], "maximum messages exceeded") {
		t.Errorf("devices b and c: dead letters %q %q; want 5 saying the total limit was hit", byDev["b"], byDev["c"])
	}
	for _, d := range []string{"a", "b", "c"} {
		f.groups.set(d, "g")
		pool.Release(d)
	}
	// Each device's first messages were parked and released in order, the rest dead-lettered.
	out := f.read("OUTGOING", 25)
	for _, d := range []string{"a", "b", "c"} {
		kept := ofDevice(out, d)
		checkOrder(t, kept, []string{d}, len(kept), func(d string) string { return "outgoing.g." + d + ".evt" })
		for i, m := range ofDevice(dead, d) {
			if want := fmt.Sprintf("%s:%d", d, len(kept)+i); string(m.Data()) != want {
				t.Errorf("device %s: dead letter %d is %q, want %q", d, i, m.Data(), want)
			}
		}
	}
	if st := pool.Stats(); st.Unmapped[wire.ReasonParkFull] != 10 {
		t.Errorf("Stats().Unmapped = %v, want 10 park-full", st.Unmapped)
	}
}

// Parked messages older than MaxAge go to UNMAPPED as park-expired, in order: the lane's own
// parks, and those a new owner finds in PARKED without knowing their age.
func TestParkMaxAge(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.parkOn(lanes.Config{}, 0, 0)
	_, stop := f.run(cfg, nil) // no MaxAge: parked as long as it takes
	f.publish([]string{"old"}, 5, nil)
	f.waitParked("old", 5)
	stop()

	cfg.Park.MaxAge, cfg.Park.SweepInterval = time.Second, 50*time.Millisecond
	pool, _ := f.run(cfg, nil)
	f.publish([]string{"new"}, 5, nil)
	f.waitParked("new", 5)
	natstest.Eventually(t, 20*time.Second, func() error {
		if n, err := f.tryCount("UNMAPPED"); err != nil || n != 10 {
			return fmt.Errorf("UNMAPPED holds %d messages, want 10 (%v)", n, err)
		}
		return nil
	})
	dead := f.read("UNMAPPED", 10)
	for _, d := range []string{"old", "new"} {
		msgs := ofDevice(dead, d)
		checkOrder(t, msgs, []string{d}, 5, func(d string) string { return "unmapped." + d + ".evt" })
		for _, m := range msgs {
			if got := m.Headers().Get(wire.HeaderReason); got != wire.ReasonParkExpired {
				t.Fatalf("%s: reason %q, want %q", m.Data(), got, wire.ReasonParkExpired)
			}
		}
	}
	f.waitParked("old", 0)
	f.waitParked("new", 0)
	// Still without a group, its next message is parked again, afresh.
	f.publishFrom([]string{"new"}, 5, 1, nil)
	f.waitParked("new", 1)
	if st := pool.Stats(); st.Unmapped[wire.ReasonParkExpired] != 10 {
		t.Errorf("Stats().Unmapped = %v, want 10 park-expired", st.Unmapped)
	}
}

// A release cut short (the lease lost mid-way: the lane stops at once, without draining or purging)
// and resumed by a new owner after OUTGOING's duplicate window loses nothing and keeps the
// device's order; it stores again exactly what was republished and not purged yet.
//
// The cut is made to strike mid-release, with part of what was stored purged and part not: the
// releasing pool's connection (natstest.Dropper) first lets `purged` publishes to OUTGOING
// through and drops the rest, so the release stalls there and purges them; then it drops the
// purges and lets the release's resends through up to `stored`; then the lease is lost.
func TestReleaseResumedAfterTheDuplicateWindow(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	eachLayout(t, func(t *testing.T, f *fixture) {
		const total, purged, stored = 2000, 300, 800
		cfg := f.parkOn(lanes.Config{}, total, total)
		cfg.Park.PurgeInterval = 10 * time.Millisecond // purged early in the release, cut after that
		ctx := context.Background()
		s, err := f.js.Stream(ctx, "OUTGOING")
		if err != nil {
			t.Fatal(err)
		}
		oc := s.CachedInfo().Config
		oc.Duplicates = 500 * time.Millisecond // setup refuses this; the lanes do not check it
		if _, err := f.js.UpdateStream(ctx, oc); err != nil {
			t.Fatal(err)
		}
		_, stop := f.run(cfg, nil)
		f.publish([]string{"late"}, total, nil)
		f.waitParked("late", total)
		stop()

		var lost atomic.Bool
		f.groups.set("late", "g")
		p := subjects.Partition("late", 16)
		relCfg := cfg
		relCfg.PublishTimeout = 300 * time.Millisecond // what was dropped is resent soon
		pool, drop := f.droppingPool(relCfg)
		drop.DropAfter("outgoing.", purged)
		cut, stop := f.runPool(pool, func(int) bool { return !lost.Load() })
		natstest.Eventually(t, 30*time.Second, func() error {
			if n, err := f.tryCount("OUTGOING"); err != nil || n != purged {
				return fmt.Errorf("OUTGOING holds %d, want the %d let through (%v)", n, purged, err)
			}
			if n, err := f.tryParked("late"); err != nil || n != total-purged {
				return fmt.Errorf("PARKED holds %d, want %d: the stored ones purged (%v)", n, total-purged, err)
			}
			// As after a stream's leader change: nothing later is stored before the release has
			// seen what it lost time out (it then resends from the first, alone).
			if pool.Stats().Failures == 0 {
				return fmt.Errorf("the release has not seen its dropped publishes fail yet")
			}
			return nil
		})
		// No purge from now on; the release's resends get through up to stored, then stall.
		drop.Set(natstest.DropRule{Prefix: "$JS.API.STREAM.PURGE."}, natstest.DropRule{Prefix: "outgoing.", Pass: stored - purged})
		natstest.Eventually(t, 30*time.Second, func() error {
			if n, err := f.tryCount("OUTGOING"); err != nil || n != stored {
				return fmt.Errorf("OUTGOING holds %d, want the %d let through (%v)", n, stored, err)
			}
			return nil
		})
		lost.Store(true) // the lease's clock runs out: the lane stops at once
		natstest.Eventually(t, 10*time.Second, func() error {
			for _, ps := range cut.Partitions() {
				if ps.Partition == p {
					return fmt.Errorf("the lane of partition %d still runs", p)
				}
			}
			return nil
		})
		if errs := stop(); !errors.Is(errs[p], lanes.ErrFenced) {
			t.Fatalf("Run(partition %d) = %v, want ErrFenced", p, errs[p])
		}
		if n, left := f.count("OUTGOING"), f.parked("late"); n != stored || left != total-purged {
			t.Fatalf("cut short with %d in OUTGOING and %d in PARKED, want %d and %d", n, left, stored, total-purged)
		}
		// Past the duplicate window: OUTGOING no longer recognises the ids of what was stored.
		time.Sleep(oc.Duplicates + 100*time.Millisecond) // the scenario, not a synchronisation: the window must pass

		pool, _ = f.run(cfg, nil)
		f.waitOrDump(pool, "OUTGOING", total+stored-purged, 30*time.Second)
		f.waitParked("late", 0)
		out := f.read("OUTGOING", f.count("OUTGOING"))
		// First the stored prefix, then the resumed release from the first message not purged.
		want := make([]int, 0, len(out))
		for k := range stored {
			want = append(want, k)
		}
		for k := purged; k < total; k++ {
			want = append(want, k)
		}
		if len(out) != len(want) {
			t.Fatalf("OUTGOING holds %d messages, want %d: late:0 to late:%d, then late:%d to late:%d again after the window",
				len(out), len(want), stored-1, purged, total-1)
		}
		for i, m := range out {
			if w := fmt.Sprintf("late:%d", want[i]); string(m.Data()) != w {
				t.Fatalf("OUTGOING message %d is %q, want %q (the %d released and not purged when cut, stored again, then the rest in order)",
					i, m.Data(), w, stored-purged)
			}
		}
		t.Logf("%d stored again after the duplicate window: the released and not purged ones", stored-purged)
	})
}

// A release whose publishes go unanswered holds back only its own device: the other devices of
// its partition, parked or not, keep flowing, and once OUTGOING answers the release completes.
func TestStuckReleaseDoesNotStallItsPartition(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.parkOn(lanes.Config{PublishTimeout: 300 * time.Millisecond}, 0, 0)
	ctx := context.Background()
	s, err := f.js.Stream(ctx, "OUTGOING")
	if err != nil {
		t.Fatal(err)
	}
	oc := s.CachedInfo().Config
	oc.Subjects = []string{"outgoing.g.>"}
	if _, err := f.js.UpdateStream(ctx, oc); err != nil {
		t.Fatal(err)
	}
	f.swallow("outgoing.stuck.>")
	devs := sameLane("late", 3)
	late, other, later := devs[0], devs[1], devs[2]
	f.groups.set(other, "g")
	pool, _ := f.run(cfg, nil)
	f.publish([]string{late}, 200, nil)
	f.waitParked(late, 200)
	f.groups.set(late, "stuck") // OUTGOING does not capture it: the release goes unanswered
	pool.Release(late)
	natstest.Eventually(t, 20*time.Second, func() error {
		if pool.Stats().Failures == 0 {
			return fmt.Errorf("the release's publishes have not timed out yet")
		}
		return nil
	})
	f.publish([]string{other, later}, 100, nil)
	checkOrder(t, f.read("OUTGOING", 100), []string{other}, 100, func(d string) string { return "outgoing.g." + d + ".evt" })
	f.waitParked(later, 100)

	oc.Subjects = []string{"outgoing.>"}
	if _, err := f.js.UpdateStream(ctx, oc); err != nil {
		t.Fatal(err)
	}
	f.waitOrDump(pool, "OUTGOING", 300, 60*time.Second)
	checkOrder(t, ofDevice(f.read("OUTGOING", 300), late), []string{late}, 200, func(d string) string { return "outgoing.stuck." + d + ".evt" })
	f.waitParked(late, 0)
}

// kvmapper unpark writes unpark.<p>.<device>: the owner releases the device's parked messages
// (with no group: dead letters as no-mapping) or drops them (park-dropped), then deletes the key.
func TestUnparkByKey(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.parkOn(lanes.Config{}, 0, 0)
	f.run(cfg, nil)
	f.publish([]string{"rel", "drop"}, 5, nil)
	f.waitParked("rel", 5)
	f.waitParked("drop", 5)
	ctx := context.Background()
	for d, v := range map[string]wire.UnparkAction{"rel": wire.UnparkRelease, "drop": wire.UnparkDrop, "none": wire.UnparkRelease} {
		if _, err := f.ctl.PutString(ctx, wire.UnparkKey(subjects.Partition(d, 16), d), string(v)); err != nil {
			t.Fatal(err)
		}
	}
	dead := f.read("UNMAPPED", 10)
	for d, reason := range map[string]string{"rel": wire.ReasonNoMapping, "drop": wire.ReasonParkDropped} {
		msgs := ofDevice(dead, d)
		checkOrder(t, msgs, []string{d}, 5, func(d string) string { return "unmapped." + d + ".evt" })
		for _, m := range msgs {
			if got := m.Headers().Get(wire.HeaderReason); got != reason {
				t.Fatalf("%s: reason %q, want %q", m.Data(), got, reason)
			}
		}
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		for _, d := range []string{"rel", "drop", "none"} {
			if _, err := f.ctl.Get(ctx, wire.UnparkKey(subjects.Partition(d, 16), d)); err == nil {
				return fmt.Errorf("the unpark key of %s is still there", d)
			}
		}
		return nil
	})
	f.waitParked("rel", 0)
	f.publishFrom([]string{"rel"}, 5, 1, nil) // still without a group: parked again
	f.waitParked("rel", 1)
}

// A lane fenced while its purge of PARKED goes unanswered returns from Run at once: the purge
// runs under parking's context, which the lane's stop cancels, rather than the lane's, which a
// fence does not end (it waited for the purge's 5 s timeout).
func TestFencedLaneDoesNotWaitForItsPurge(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "late"
	cfg := f.parkOn(lanes.Config{}, 0, 0)
	pool, drop := f.droppingPool(cfg)
	var lost atomic.Bool
	_, res := runLane(t, pool, lanes.Assignment{Partition: subjects.Partition(dev, f.lay.Partitions), Epoch: 1,
		Valid: func() bool { return !lost.Load() }})
	f.publish([]string{dev}, 10, nil)
	f.waitParked(dev, 10)
	drop.Drop("$JS.API.STREAM.PURGE.PARKED") // the purge after the release goes unanswered
	f.groups.set(dev, "g")
	pool.Release(dev)
	f.read("OUTGOING", 10)
	natstest.Eventually(t, 20*time.Second, func() error {
		if drop.Dropped() == 0 {
			return fmt.Errorf("the lane has sent no purge of PARKED yet")
		}
		return nil
	})
	fenced := time.Now()
	lost.Store(true)
	select {
	case err := <-res:
		took := time.Since(fenced)
		t.Logf("Run returned %v after the fence: %v", took.Round(time.Millisecond), err)
		if took > 2500*time.Millisecond {
			t.Errorf("Run returned %v after the fence, with its purge in flight: want well under the purge's 5 s timeout", took.Round(time.Millisecond))
		}
		if !errors.Is(err, lanes.ErrFenced) {
			t.Errorf("Run = %v, want ErrFenced", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run has not returned 30 s after the fence")
	}
}

// A park carries the provenance of the owner that parked it; what its release publishes carries
// the releasing lane's, or none: here a replica with provenance off releases what one with it on
// parked, and OUTGOING must hold no KVMapper-Prov.
func TestReleaseCarriesNoParkersProvenance(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	_, stop := f.run(f.parkOn(lanes.Config{}, 0, 0), nil)
	f.publish([]string{"late"}, 20, nil)
	f.waitParked("late", 20)
	for _, m := range f.readFirst("PARKED", 20) {
		if m.Headers().Get(wire.HeaderProvenance) == "" {
			t.Fatalf("parked %q without KVMapper-Prov: the test proves nothing", m.Data())
		}
	}
	stop()
	f.groups.set("late", "g")
	f.run(f.parkOn(lanes.Config{NoProvenance: true}, 0, 0), nil)
	out := f.read("OUTGOING", 20)
	checkOrder(t, out, []string{"late"}, 20, func(d string) string { return "outgoing.g." + d + ".evt" })
	for _, m := range out {
		if v := m.Headers().Get(wire.HeaderProvenance); v != "" {
			t.Errorf("released %q with KVMapper-Prov %q, the parking owner's, from a lane with provenance off", m.Data(), v)
		}
	}
}
