package election_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/wire"
)

// runs records every Work run of every replica, allowing overlaps: with JudgedExpiry an owner
// judged dead may still run (the output fence, not the election, keeps its writes out).
type runs struct {
	mu      sync.Mutex
	started map[int][]run // by partition, in start order
}

type run struct {
	replica string
	epoch   uint64
	checked string // Lease.Checked
	at      time.Time
	ended   time.Time
	cause   error
}

func newRuns() *runs { return &runs{started: map[int][]run{}} }

func (rs *runs) work(id string) election.Work {
	return func(ctx context.Context, l *election.Lease) error {
		rs.mu.Lock()
		rs.started[l.Partition] = append(rs.started[l.Partition], run{replica: id, epoch: l.Epoch, checked: l.Checked, at: time.Now()})
		i := len(rs.started[l.Partition]) - 1
		rs.mu.Unlock()
		<-ctx.Done()
		rs.mu.Lock()
		rs.started[l.Partition][i].ended, rs.started[l.Partition][i].cause = time.Now(), context.Cause(ctx)
		rs.mu.Unlock()
		return nil
	}
}

// last returns partition p's latest run.
func (rs *runs) last(p int) run {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	r := rs.started[p]
	if len(r) == 0 {
		return run{}
	}
	return r[len(r)-1]
}

func (rs *runs) count() int {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	n := 0
	for _, r := range rs.started {
		n += len(r)
	}
	return n
}

const (
	judgedTTL   = 10 * time.Second
	judgedRenew = 250 * time.Millisecond
	judgedAfter = time.Second
)

func judgedConfig(c *election.Config) {
	c.LeaseTTL, c.RenewInterval, c.JudgedExpiry, c.Grace = judgedTTL, judgedRenew, judgedAfter, judgedTTL
}

// TestJudgedExpiryTakesOverASilentOwner cuts one owner off from the control bucket while it
// stays connected (its publishes to $KV.kvmapper. vanish, as when its server lost the route to
// the bucket's leader): the other replica, whose own writes go on being stored and seen, takes
// its partitions over after about JudgedExpiry, long before their 10s TTL could expire; the cut
// owner, once its writes reach the bucket again, finds every one of them taken (ErrLeaseLost).
// Without JudgedExpiry nothing moves before the TTL.
func TestJudgedExpiryTakesOverASilentOwner(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	const P = 4
	for _, judged := range []bool{true, false} {
		name := map[bool]string{true: "judged", false: "off"}[judged]
		t.Run(name, func(t *testing.T) {
			srv := natstest.Start(t)
			_, js := srv.JetStream(t)
			newBucket(t, js)
			mod := func(c *election.Config) {
				judgedConfig(c)
				if !judged {
					c.JudgedExpiry = 0
				}
			}
			rs := newRuns()
			drop := &natstest.Dropper{}
			anc, ajs := srv.JetStream(t, nats.SetCustomDialer(drop))
			a := runReplica(t, anc, ajs, "a", P, rs.work("a"), mod)
			b := startReplica(t, srv, "b", P, rs.work("b"), mod)
			natstest.Eventually(t, 10*time.Second, ownsCount(a, P/2, P/2))
			natstest.Eventually(t, 10*time.Second, ownsCount(b, P/2, P/2))
			cut := a.e.Owned()

			drop.Drop("$KV." + bucket + ".")
			dropped := time.Now()
			if !judged {
				// Not a synchronisation: the time in which nothing may move.
				<-time.After(3 * judgedAfter)
				if got := b.e.Owned(); len(got) != P/2 {
					t.Fatalf("b owns %v %v after the cut without JudgedExpiry, want its own %d only", got, time.Since(dropped), P/2)
				}
				return
			}
			natstest.Eventually(t, judgedTTL/2, ownsCount(b, P, P))
			for _, p := range cut {
				r := rs.last(p)
				took := r.at.Sub(dropped)
				t.Logf("partition %d taken over by %s %v after a's writes stopped reaching the bucket", p, r.replica, took.Round(time.Millisecond))
				if r.replica != "b" || took < judgedAfter-judgedRenew || took > 3*judgedAfter {
					t.Errorf("partition %d: run by %s %v after the cut, want b after about %v (JudgedExpiry)", p, r.replica, took, judgedAfter)
				}
			}
			drop.Drop("")
			// a's runs of the partitions it was cut off with end: its next renewal is refused.
			// (It may claim partitions again later, when b hands its excess back.)
			natstest.Eventually(t, judgedTTL, func() error {
				rs.mu.Lock()
				defer rs.mu.Unlock()
				for _, p := range cut {
					for _, r := range rs.started[p] {
						if r.replica == "a" && r.at.Before(dropped) && r.ended.IsZero() {
							return fmt.Errorf("a still runs partition %d", p)
						}
					}
				}
				return nil
			})
			rs.mu.Lock()
			for _, p := range cut {
				for _, r := range rs.started[p] {
					if r.replica == "a" && r.at.Before(dropped) && !errors.Is(r.cause, election.ErrLeaseLost) {
						t.Errorf("partition %d: a's run ended with %v, want ErrLeaseLost", p, r.cause)
					}
				}
			}
			rs.mu.Unlock()
		})
	}
}

// TestJudgedExpiryWaitsForWritableTime makes the control bucket take nobody's writes for three
// times JudgedExpiry (every replica's publishes to it vanish, as while the bucket elects a
// leader), then take them again: no lease may be taken over, since nobody's own writes were
// stored meanwhile, and none may be lost, since the TTL outlasts the gap.
func TestJudgedExpiryWaitsForWritableTime(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	const P = 4
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)
	rs := newRuns()
	var drops []*natstest.Dropper
	var reps []*replica
	for _, id := range []string{"a", "b", "c"} {
		d := &natstest.Dropper{}
		nc, rjs := srv.JetStream(t, nats.SetCustomDialer(d))
		reps = append(reps, runReplica(t, nc, rjs, id, P, rs.work(id), judgedConfig))
		drops = append(drops, d)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		n := 0
		for _, r := range reps {
			n += len(r.e.Owned())
		}
		if n != P {
			return errors.New("not every partition owned yet")
		}
		return nil
	})
	before := rs.count()
	owned := make([][]int, len(reps))
	for i, r := range reps {
		owned[i] = r.e.Owned()
	}
	for _, d := range drops {
		d.Drop("$KV." + bucket + ".")
	}
	// Not a synchronisation: the length of the outage.
	<-time.After(3 * judgedAfter)
	for _, d := range drops {
		d.Drop("")
	}
	// Two JudgedExpiry of writable time after it: long enough for a wrong judgement to show.
	<-time.After(2 * judgedAfter)
	if n := rs.count(); n != before {
		t.Errorf("%d Work runs started during and after the outage, want none", n-before)
	}
	for i, r := range reps {
		if got := r.e.Owned(); !slices.Equal(got, owned[i]) {
			t.Errorf("%s owns %v after the outage, want %v as before", r.id, got, owned[i])
		}
	}
}

// TestWorkFencedIsALostLease: a Work that returns an error wrapping ErrLeaseLost (it found a
// newer owner's fence on its output) ends the lease as lost: the lease key is not deleted, which
// would be the newer owner's, and no failure is logged as the work's.
func TestWorkFencedIsALostLease(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	fenced := make(chan struct{})
	var once sync.Once
	r := startReplica(t, srv, "a", 1, func(ctx context.Context, l *election.Lease) error {
		first := false
		once.Do(func() { first = true })
		if !first {
			<-ctx.Done()
			return nil
		}
		close(fenced)
		return fmt.Errorf("lanes: fenced: %w", election.ErrLeaseLost)
	})
	select {
	case <-fenced:
	case <-time.After(10 * time.Second):
		t.Fatal("partition 0 not claimed within 10s")
	}
	// Once the holder is gone, the key is still there (until its TTL of 1s runs out): the holder
	// did not delete it.
	natstest.Eventually(t, 5*time.Second, ownsCount(r, 0, 0))
	e, err := kv.Get(context.Background(), "lease.0")
	if err != nil {
		t.Fatalf("Get(lease.0) right after the fenced Work returned: %v, want the lease still there", err)
	}
	if string(e.Value()) != "a" {
		t.Errorf("lease.0 = %q, want a's", e.Value())
	}
}

// TestDeafMemberIsLeftOutOfTheQuotas heartbeats a member b by hand, its value saying when it
// last saw its own writes back (wire.MemberValue), beside a real replica a: while b hears the
// bucket a's quota is half the partitions; once b's heartbeats say it has heard nothing for 10s
// (what reaches the bucket from a replica after a network cut heals, before the bucket's answers
// reach it again), a takes them all, handing none to b, which could not take them; when b hears
// again, a hands its share back.
func TestDeafMemberIsLeftOutOfTheQuotas(t *testing.T) {
	t.Parallel()
	const P = 4
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	var deafSince atomic.Pointer[time.Time]
	ctx, cancel := context.WithCancel(context.Background())
	beats := make(chan struct{})
	go func() {
		defer close(beats)
		tick := time.NewTicker(judgedRenew)
		defer tick.Stop()
		for {
			heard := time.Now().Add(-judgedRenew)
			if d := deafSince.Load(); d != nil {
				heard = *d
			}
			if _, err := kv.Put(ctx, wire.MemberKey("b"), wire.MemberValue("b", heard)); err != nil && ctx.Err() == nil {
				t.Errorf("heartbeat of b: %v", err)
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-beats })
	natstest.Eventually(t, 5*time.Second, func() error {
		_, err := kv.Get(context.Background(), wire.MemberKey("b"))
		return err
	})
	rs := newRuns()
	// Grace outlasts the test: a claims only what its quota gives it.
	a := startReplica(t, srv, "a", P, rs.work("a"), func(c *election.Config) {
		judgedConfig(c)
		c.Grace = time.Minute
	})
	natstest.Eventually(t, 10*time.Second, ownsCount(a, P/2, P/2))

	since := time.Now().Add(-10 * time.Second)
	deafSince.Store(&since)
	natstest.Eventually(t, 10*time.Second, ownsCount(a, P, P))

	deafSince.Store(nil)
	natstest.Eventually(t, 10*time.Second, ownsCount(a, P/2, P/2))
}

// TestJudgeOnlyOwnersItVouchesFor: a silent owner is judged dead early only when the last write
// of its lease carried, in its Kvmapper-Lease-Checked header (Config.Checked), what the judge's
// Config.Judge accepts; others keep their lease until it expires. c advertises "ok" on its
// renewals, a nothing (a build from before the advertisement); both are cut off from the bucket
// at once. b takes c's partitions after about JudgedExpiry, each Lease naming what c vouched
// for, and leaves a's alone: nothing says a's writes would be refused after a takeover.
func TestJudgeOnlyOwnersItVouchesFor(t *testing.T) {
	t.Parallel()
	const P = 6
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)
	rs := newRuns()
	judge := func(c *election.Config) {
		judgedConfig(c)
		c.Judge = func(checked string) bool { return checked == "ok" }
	}
	drops := map[string]*natstest.Dropper{"a": {}, "c": {}}
	reps := map[string]*replica{}
	for _, id := range []string{"a", "b", "c"} {
		mods := []func(*election.Config){judge}
		if id == "c" {
			mods = append(mods, func(c *election.Config) {
				c.Checked = func(int, uint64) string { return "ok" }
			})
		}
		nc, rjs := srv.JetStream(t)
		if d := drops[id]; d != nil {
			nc, rjs = srv.JetStream(t, nats.SetCustomDialer(d))
		}
		reps[id] = runReplica(t, nc, rjs, id, P, rs.work(id), mods...)
	}
	for _, id := range []string{"a", "b", "c"} {
		natstest.Eventually(t, 10*time.Second, ownsCount(reps[id], P/3, P/3))
	}
	unchecked, checked := reps["a"].e.Owned(), reps["c"].e.Owned()
	// A claim carries no header: c's leases vouch once c renewed them.
	natstest.Eventually(t, 5*time.Second, func() error {
		for _, p := range checked {
			m, err := kvcas.Latest(context.Background(), js, bucket, wire.LeaseKey(p))
			if err != nil {
				return err
			}
			if got := m.Header.Get("Kvmapper-Lease-Checked"); got != "ok" {
				return fmt.Errorf("lease %d's last write carries Kvmapper-Lease-Checked %q, want c's ok", p, got)
			}
		}
		return nil
	})
	for _, d := range drops {
		d.Drop("$KV." + bucket + ".")
	}
	cut := time.Now()
	natstest.Eventually(t, 3*judgedAfter+time.Second, func() error {
		owned := reps["b"].e.Owned()
		for _, p := range checked {
			if !slices.Contains(owned, p) {
				return fmt.Errorf("b owns %v, not yet c's partition %d", owned, p)
			}
		}
		return nil
	})
	took := time.Since(cut)
	if took > judgedTTL/2 {
		t.Fatalf("b took c's partitions %v after the cut, near their TTL: the test proves nothing", took)
	}
	for _, p := range checked {
		if r := rs.last(p); r.replica != "b" || r.checked != "ok" {
			t.Errorf("partition %d: last run by %s with Lease.Checked %q, want b's, naming what c vouched for", p, r.replica, r.checked)
		}
	}
	// a's went silent as long ago, longer than JudgedExpiry: b must have judged and left them.
	for _, p := range reps["b"].e.Owned() {
		if slices.Contains(unchecked, p) {
			t.Errorf("b took a's partition %d %v after a went silent, before its lease (%v) expired: a vouched for nothing", p, took, judgedTTL)
		}
	}
	for _, d := range drops {
		d.Drop("")
	}
}
