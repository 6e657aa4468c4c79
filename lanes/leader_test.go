package lanes_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// What a lane sees of an output stream that loses its leader, played on one server with a
// connection that loses publishes: nothing answers the publishes in flight, and the stream then
// stores whatever reaches it next. The lane must keep each device's order through it.

// publishPaced publishes payloads "<device>:from" … "<device>:from+n-1", one every gap: load
// that goes on while the stream is away.
func (f *fixture) publishPaced(device string, from, n int, gap time.Duration) {
	f.t.Helper()
	tick := time.NewTicker(gap)
	defer tick.Stop()
	for i := from; i < from+n; i++ {
		<-tick.C
		f.publishFrom([]string{device}, i, 1, nil)
	}
}

// A stream silent for 3.5s, while its device keeps publishing, then back (on a cluster a new
// leader comes 3s after the old one's death at the earliest): what was sent into the silence
// must be stored before anything sent after it, although the publish timeout (5s) is not over
// when the stream is back.
func TestSilentStreamKeepsOrder(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	f := newFixture(t)
	dev := "dev-1"
	f.groups.set(dev, "g")
	pool, drop := f.droppingPool(lanes.Config{})
	runLane(t, pool, lanes.Assignment{Partition: subjects.Partition(dev, 16), Epoch: 1})
	f.publish([]string{dev}, 1, nil)
	f.read("OUTGOING", 1)

	drop.Drop("outgoing.")
	f.publishPaced(dev, 1, 35, 100*time.Millisecond) // 3.5s of silence
	drop.Drop("")
	f.publishPaced(dev, 36, 20, 50*time.Millisecond) // and 1s after it, within the timeout
	f.waitOrDump(pool, "OUTGOING", 56, 30*time.Second)
	checkOrder(t, f.read("OUTGOING", 56), []string{dev}, 56, func(string) string { return "outgoing.g.dev-1.evt" })
	if st := pool.Stats(); st.Reorders != 0 {
		t.Errorf("Stats() = %+v, want no reorder", st)
	}
	t.Logf("dropped %d publishes; Stats() = %+v", drop.Dropped(), pool.Stats())
}

// The stream comes back in the middle of a resend round: the start of the round is lost, the
// rest would be stored. The lane resends the first message alone until it is stored, and only
// then the rest, so nothing lands behind a later message of its device.
func TestStreamBackInTheMiddleOfAResendKeepsOrder(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dev := "dev-1"
	f.groups.set(dev, "g")
	pool, drop := f.droppingPool(lanes.Config{PublishTimeout: 300 * time.Millisecond, RetryBackoff: 10 * time.Millisecond})
	runLane(t, pool, lanes.Assignment{Partition: subjects.Partition(dev, 16), Epoch: 1})
	f.publish([]string{dev}, 1, nil)
	f.read("OUTGOING", 1)

	// Everything the lane sends of the 50 is lost until a round of resends has begun, and then
	// the next two publishes: the stream is back in the middle of a round. (Which of its
	// publishes a round's start is depends on the mode: on this one-replica stream the lane
	// writes fast-ingest batches, whose resends after a lost outcome go one at a time; counting
	// a fixed number of drops from the first send would make the test's length depend on how
	// many of the 50 the first batch held.)
	const n, lostAfter = 50, 2
	drop.Drop("outgoing.")
	f.publishFrom([]string{dev}, 1, n, nil)
	natstest.Eventually(t, 20*time.Second, func() error {
		if st := pool.Stats(); st.Retries == 0 {
			return fmt.Errorf("no message resent yet; %+v", st)
		}
		return nil
	})
	before := drop.DropNext("outgoing.", lostAfter)
	f.waitOrDump(pool, "OUTGOING", 1+n, 30*time.Second)
	checkOrder(t, f.read("OUTGOING", 1+n), []string{dev}, 1+n, func(string) string { return "outgoing.g.dev-1.evt" })
	if before == 0 {
		t.Errorf("nothing was dropped before the round of resends began")
	}
	if got := drop.Dropped() - before; got != lostAfter {
		t.Errorf("dropped %d publishes of the round of resends, want %d", got, lostAfter)
	}
	if st := pool.Stats(); st.Reorders != 0 {
		t.Errorf("Stats() = %+v, want no reorder", st)
	}
}

// A publish lost while a later one to the same stream is stored (a leader stepping down drops
// what it had queued; the new one stores what comes next) is resent as soon as the later one's
// acknowledgement shows it lost, not after the publish timeout. That is the single-publish path
// (Config.Singles, or a stream without batches), where the later one is stored first; in a batch
// (the default) nothing after the lost message is stored, and it is resent as soon as the batch
// says where it stopped.
func TestOvertakenPublishIsResentAtOnce(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		singles bool
		want    string // OUTGOING's payloads, %s the other device
	}{
		"singles": {true, "[dev-a:0 %[1]s:1 dev-a:1]"},
		"batches": {false, "[dev-a:0 dev-a:1 %[1]s:1]"},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			a := "dev-a"
			p := subjects.Partition(a, 16)
			b := ""
			for i := 0; b == ""; i++ {
				if d := fmt.Sprintf("dev-b%d", i); subjects.Partition(d, 16) == p {
					b = d
				}
			}
			f.groups.set(a, "g")
			f.groups.set(b, "g")
			// No stall detection: only the later acknowledgement can tell.
			pool, drop := f.droppingPool(lanes.Config{StallTimeout: -1, Singles: tc.singles})
			// dev-a:1 is lost, and dev-a:0 before it and the other device's message after it
			// go through. The three are in INCOMING before the lane starts, so that it reads
			// them in one pull: a claim's first message goes alone (the writer's probe), and
			// the two behind it then go together, as one batch in batch mode. Published while
			// the lane runs, dev-a:1 could go as a batch of its own, with nothing after it
			// that could show it lost before the publish timeout.
			drop.Set(natstest.DropRule{Prefix: "outgoing.g." + a + ".", Pass: 1, Next: 1})
			f.publish([]string{a}, 1, nil)
			f.publishFrom([]string{a, b}, 1, 1, nil)
			start := time.Now()
			runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1})
			f.waitOrDump(pool, "OUTGOING", 3, 30*time.Second)
			if took := time.Since(start); took > 2500*time.Millisecond {
				t.Errorf("the lost publish was stored %v after it was sent, want well below the 5s publish timeout", took)
			}
			msgs := f.read("OUTGOING", 3)
			if got, want := fmt.Sprint(payloads(msgs)), fmt.Sprintf(tc.want, b); got != want {
				t.Errorf("OUTGOING holds %s, want %s", got, want)
			}
			if drop.Dropped() != 1 {
				t.Errorf("dropped %d publishes, want 1", drop.Dropped())
			}
			t.Logf("resent after %v; Stats() = %+v", time.Since(start), pool.Stats())
		})
	}
}
