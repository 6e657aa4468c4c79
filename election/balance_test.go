package election_test

import (
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// running returns how many Works each replica runs, and how many Works have started in all.
func (tr *tracker) running() (map[string]int, int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	per := map[string]int{}
	for _, id := range tr.owner {
		per[id]++
	}
	started := 0
	for _, n := range tr.starts {
		started += n
	}
	return per, started
}

// balanced returns a check, for natstest.Eventually, that every partition runs on one of rs and
// that each of rs owns and runs lo to hi partitions.
func balanced(tr *tracker, partitions, lo, hi int, rs ...*replica) func() error {
	return func() error {
		per, _ := tr.running()
		total := 0
		for _, r := range rs {
			owned := len(r.e.Owned())
			if owned < lo || owned > hi || per[r.id] != owned {
				return fmt.Errorf("%s owns %d partitions and runs %d, want %d…%d (running %v)", r.id, owned, per[r.id], lo, hi, per)
			}
			total += owned
		}
		if total != partitions {
			return fmt.Errorf("%d partitions owned, want %d (running %v)", total, partitions, per)
		}
		return nil
	}
}

// quiet fails the test if any Work ends within d: the assignment is steady.
func quiet(t *testing.T, tr *tracker, d time.Duration) {
	t.Helper()
	select {
	case e := <-tr.ends:
		t.Fatalf("Work end %+v after the assignment balanced, want it steady", e)
	case <-time.After(d):
	}
}

// drain discards the recorded Work ends.
func drain(tr *tracker) {
	for {
		select {
		case <-tr.ends:
		default:
			return
		}
	}
}

// TestBalanceJoinAndKill starts three replicas together, adds a fourth, then kills one: each
// step ends with every replica owning P/n ± 1 partitions, moving no more than the minimum.
func TestBalanceJoinAndKill(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	const P = 16
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)
	tr := newTracker(t)

	start := time.Now()
	var rs []*replica
	for _, id := range []string{"r0", "r1", "r2"} {
		rs = append(rs, startReplica(t, srv, id, P, tr.work(id)))
	}
	natstest.Eventually(t, 10*time.Second, balanced(tr, P, 5, 6, rs...))
	per, started := tr.running()
	t.Logf("3 replicas: %v after %v, %d Work starts", per, time.Since(start), started)
	if started != P {
		t.Errorf("3 replicas started together: %d Work starts, want %d (no start-up churn)", started, P)
	}
	quiet(t, tr, 2*ttl)

	joined := time.Now()
	rs = append(rs, startReplica(t, srv, "r3", P, tr.work("r3")))
	natstest.Eventually(t, 10*time.Second, balanced(tr, P, 4, 4, rs...))
	per, after := tr.running()
	moved := after - started
	t.Logf("r3 joined: %v after %v, %d partitions changed owner", per, time.Since(joined), moved)
	if limit := (P+3)/4 + 1; moved > limit {
		t.Errorf("r3 joining moved %d partitions, want ≤ ⌈P/4⌉+1 = %d", moved, limit)
	}
	drain(tr)
	quiet(t, tr, 2*ttl)

	killed := time.Now()
	victim := rs[1]
	before := len(victim.e.Owned())
	victim.nc.Close()
	survivors := []*replica{rs[0], rs[2], rs[3]}
	natstest.Eventually(t, 10*time.Second, balanced(tr, P, 5, 6, survivors...))
	per, final := tr.running()
	t.Logf("%s killed: %v after %v, %d partitions changed owner", victim.id, per, time.Since(killed), final-after)
	if final-after != before {
		t.Errorf("killing %s (%d partitions) moved %d, want only its own", victim.id, before, final-after)
	}
	for r, n := range maps.All(per) {
		if r == victim.id && n > 0 {
			t.Errorf("killed %s still runs %d partitions", r, n)
		}
	}
}
