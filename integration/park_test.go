package integration

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// parkFlags run a replica that parks devices without a group.
var parkFlags = []string{"--on-unmapped", "park", "--park-max-per-device", "10000"}

// parked returns how many messages PARKED holds for device.
// A request that fails (just after a server restart one may time out) is made again, for up to
// 10 s.
func (e *env) parked(device string) int {
	e.t.Helper()
	subj := subjects.ParkedSubject("parked", subjects.Partition(device, partitions), device)
	var n int
	natstest.Eventually(e.t, 10*time.Second, func() error {
		s, err := e.js.Stream(context.Background(), "PARKED")
		if err != nil {
			return fmt.Errorf("reading PARKED: %w", err)
		}
		info, err := s.Info(context.Background(), jetstream.WithSubjectFilter(subj))
		if err != nil {
			return fmt.Errorf("reading PARKED: %w", err)
		}
		n = int(info.State.Subjects[subj])
		return nil
	})
	return n
}

func (e *env) waitParked(device string, n int) {
	e.t.Helper()
	natstest.Eventually(e.t, 30*time.Second, func() error {
		if got := e.parked(device); got != n {
			return fmt.Errorf("PARKED holds %d messages of %s, want %d", got, device, n)
		}
		return nil
	})
}

// checkDevice checks that OUTGOING holds device's messages 0..n-1, in order, each once, on subject.
func (e *env) checkDevice(device string, n int, subject string) {
	e.t.Helper()
	var mine []jetstream.Msg
	for _, m := range e.readStream("OUTGOING", e.count("OUTGOING"), 30*time.Second) {
		if strings.HasPrefix(string(m.Data()), device+":") {
			mine = append(mine, m)
		}
	}
	got := perDevice(e.t, mine, map[string]int{device: n})
	for i, s := range got[device] {
		if s != subject {
			e.t.Fatalf("%s message %d went to %s, want %s", device, i, s, subject)
		}
	}
}

// natsKVPut gives device group with the nats CLI, as the docs tell an operator to.
func (e *env) natsKVPut(device, group string) {
	e.t.Helper()
	out, err := exec.Command("go", "tool", "nats", "--server", e.srv.URL(), "kv", "put", "device-groups", device, group).CombinedOutput()
	if err != nil {
		e.t.Fatalf("go tool nats kv put device-groups %s %s: %v\n%s", device, group, err, out)
	}
}

func (e *env) verifyOK() {
	e.t.Helper()
	out, errOut, code := e.cli("verify")
	if code != 0 {
		e.t.Fatalf("kvmapper verify: exit %d\n%s\n%s", code, out, errOut)
	}
}

// A device publishes 100 messages before it is provisioned and 100 after: OUTGOING holds all
// 200, in order, under its group; status shows it parked meanwhile; kvmapper unpark empties
// another device's park by hand.
func TestParkUntilProvisioned(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		e.put("dev-on", "g")
		e.startMapper("m1", parkFlags...)
		ld := newLoad(t, e.js)
		ld.publish([]string{"dev-late", "dev-on"}, 100)
		e.waitParked("dev-late", 100)
		waitCount(t, e, "outgoing.g.dev-on.>", 100)
		out, errOut, code := e.cli("status", "--rate-window", "0")
		if code != 0 || !strings.Contains(out, "stream PARKED: 100 messages parked, of 1 devices") || !strings.Contains(out, "dev-late") {
			t.Errorf("kvmapper status: exit %d, want dev-late's 100 parked messages shown:\n%s%s", code, out, errOut)
		}
		if out, errOut, code := e.cli("verify"); code != 0 || !strings.Contains(out, "100 messages are parked in PARKED") {
			t.Errorf("kvmapper verify while parked: exit %d, want OK with 100 parked:\n%s%s", code, out, errOut)
		}

		e.natsKVPut("dev-late", "group-a")
		ld.publish([]string{"dev-late"}, 100)
		waitCount(t, e, "outgoing.group-a.dev-late.>", 200)
		e.checkDevice("dev-late", 200, "outgoing.group-a.dev-late.evt")
		e.waitParked("dev-late", 0)

		ld.publish([]string{"dev-x", "dev-y"}, 5)
		e.waitParked("dev-x", 5)
		e.waitParked("dev-y", 5)
		if out, errOut, code := e.cli("unpark", "dev-x"); code != 0 || !strings.Contains(out, "dev-x: 5 messages were parked") {
			t.Errorf("kvmapper unpark dev-x: exit %d\n%s%s", code, out, errOut)
		}
		if out, errOut, code := e.cli("unpark", "--drop", "dev-y"); code != 0 || !strings.Contains(out, "park-dropped") {
			t.Errorf("kvmapper unpark --drop dev-y: exit %d\n%s%s", code, out, errOut)
		}
		for _, m := range e.readStream("UNMAPPED", 10, 30*time.Second) {
			want := "no-mapping"
			if strings.HasPrefix(string(m.Data()), "dev-y:") {
				want = "park-dropped"
			}
			if got := m.Headers().Get("KVMapper-Reason"); got != want {
				t.Errorf("UNMAPPED %s %q: reason %q, want %q", m.Subject(), m.Data(), got, want)
			}
		}
		e.verifyOK()
	})
}

// A kill -9 of the owner while it parks a device loses nothing: the owner is killed the moment
// it checkpoints past some of the device's parks, with most of its backlog still to park (10,000
// at about 36k parks a second, BENCHMARKS.md, against a 20 ms checkpoint interval; the test fails
// if the kill came after the last). The next replica must find the device in PARKED (those parks
// are behind its checkpoint), park the rest behind them (a park stored again is dropped by PARKED
// as a duplicate) and keep the device's later messages behind them.
func TestParkedSurviveKillNine(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		const n = 10000
		ld := newLoad(t, e.js)
		ld.publish([]string{"dev-late"}, n)
		p := subjects.Partition("dev-late", partitions)
		// The checkpoint as the control bucket stores it, not as it is sent: a write in flight
		// may not be stored.
		w, err := e.ctl.Watch(context.Background(), wire.CheckpointKey(p), jetstream.UpdatesOnly())
		if err != nil {
			t.Fatal(err)
		}
		flags := []string{"--on-unmapped", "park", "--park-max-per-device", "20000"}
		m1 := e.startMapper("m1", append(flags, "--checkpoint-interval", "20ms")...)
		deadline := time.After(60 * time.Second)
	wait:
		for {
			select {
			case u := <-w.Updates():
				if u == nil {
					continue
				}
				if cp, err := wire.ParseCheckpoint(u.Value()); err == nil && cp.Seq > 0 {
					_ = m1.cmd.Process.Signal(syscall.SIGKILL)
					break wait
				}
			case <-deadline:
				t.Fatal("m1 stored no checkpoint past a park in 60s")
			}
		}
		<-m1.done
		_ = w.Stop()
		parked, cp := e.parked("dev-late"), e.checkpoint(p)
		t.Logf("m1 killed at its first checkpoint past a park (%d); PARKED held %d of %d", cp, parked, n)
		if parked >= n || cp == 0 {
			t.Fatalf("m1 killed with PARKED holding %d of %d, checkpoint %d: want parks in flight and a checkpoint past some", parked, n, cp)
		}

		e.natsKVPut("dev-late", "group-a")
		ld.publish([]string{"dev-late"}, 100)
		e.startMapper("m2", flags...)
		waitCount(t, e, "outgoing.group-a.dev-late.>", n+100)
		e.checkDevice("dev-late", n+100, "outgoing.group-a.dev-late.evt")
		e.waitParked("dev-late", 0)
		e.verifyOK()
	})
}

// A kill -9 of the owner in the middle of a release (at the first released message seen on the
// wire) loses and duplicates nothing: the next owner resumes the release after what OUTGOING
// holds, and the device's later messages follow.
func TestReleaseSurvivesKillNine(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		m1 := e.startMapper("m1", parkFlags...)
		ld := newLoad(t, e.js)
		const n = 5000
		ld.publish([]string{"dev-late"}, n)
		e.waitParked("dev-late", n)

		var once sync.Once
		killed := make(chan struct{})
		tap := e.srv.Connect(t)
		sub, err := tap.Subscribe("outgoing.group-a.dev-late.>", func(*nats.Msg) {
			once.Do(func() {
				_ = m1.cmd.Process.Signal(syscall.SIGKILL)
				close(killed)
			})
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := tap.Flush(); err != nil { // interest in place before the put releases anything
			t.Fatal(err)
		}
		e.put("dev-late", "group-a")
		<-killed
		<-m1.done
		_ = sub.Unsubscribe()
		stored := e.count("OUTGOING")
		t.Logf("m1 killed at its first released message; OUTGOING held %d of %d", stored, n)
		if stored >= n {
			t.Fatalf("the release completed before the kill (OUTGOING holds %d): nothing was cut short", stored)
		}

		e.startMapper("m2", parkFlags...)
		ld.publish([]string{"dev-late"}, 100)
		waitCount(t, e, "outgoing.group-a.dev-late.>", n+100)
		e.checkDevice("dev-late", n+100, "outgoing.group-a.dev-late.evt")
		e.waitParked("dev-late", 0)
		e.verifyOK()
	})
}

// Parking turned off (a replica run without --on-unmapped park) still releases what PARKED holds,
// in order, but parks nothing new.
func TestParkingTurnedOffStillReleases(t *testing.T) {
	e := newEnv(t)
	m1 := e.startMapper("m1", parkFlags...)
	ld := newLoad(t, e.js)
	ld.publish([]string{"dev-late"}, 100)
	e.waitParked("dev-late", 100)
	m1.stop()

	e.startMapper("m2") // --on-unmapped dead-letter
	e.put("dev-late", "group-a")
	ld.publish([]string{"dev-late", "dev-new"}, 100)
	waitCount(t, e, "outgoing.group-a.dev-late.>", 200)
	e.checkDevice("dev-late", 200, "outgoing.group-a.dev-late.evt")
	for _, m := range e.readStream("UNMAPPED", 100, 30*time.Second) {
		if got := m.Headers().Get("KVMapper-Reason"); got != "no-mapping" || !strings.HasPrefix(string(m.Data()), "dev-new:") {
			t.Fatalf("UNMAPPED %q: reason %q; want dev-new's messages as no-mapping", m.Data(), got)
		}
	}
	e.waitParked("dev-late", 0)
	e.verifyOK()
}
