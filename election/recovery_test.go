package election_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// TestWorkErrorReleasesAndReclaims checks that a Work that fails gives the lease up and that
// the partition is claimed again after a backoff.
func TestWorkErrorReleasesAndReclaims(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	var runs atomic.Int32
	failed := make(chan time.Time, 1)
	again := make(chan time.Time, 1)
	var epochs [2]uint64
	r := startReplica(t, srv, "a", 1, func(ctx context.Context, l *election.Lease) error {
		if runs.Add(1) == 1 {
			epochs[0] = l.Epoch
			failed <- time.Now()
			return errors.New("boom")
		}
		epochs[1] = l.Epoch
		again <- time.Now()
		<-ctx.Done()
		return nil
	})
	var f time.Time
	select {
	case f = <-failed:
	case <-time.After(10 * time.Second):
		t.Fatalf("no lease granted within 10s")
	}
	natstest.Eventually(t, 2*time.Second, func() error { return keyGone(t, kv, "lease.0") })
	select {
	case at := <-again:
		t.Logf("failed Work → reclaimed after %v", at.Sub(f))
		if d := at.Sub(f); d < ttl/2 {
			t.Errorf("reclaimed %v after the failure, want a backoff of about the TTL", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("partition not reclaimed within 5s of a failed Work")
	}
	if epochs[1] <= epochs[0] {
		t.Errorf("epochs %v, want the reclaim's epoch larger", epochs)
	}
	if err := r.stop(t); err != nil {
		t.Errorf("Run() = %v, want nil", err)
	}
}

// TestGraceClaimsFromSilentMember registers a member that never claims anything: the live
// replica takes its partitions after Grace, and keeps them.
func TestGraceClaimsFromSilentMember(t *testing.T) {
	t.Parallel()
	const P = 16
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	if _, err := kv.Put(context.Background(), "member.ghost", []byte("ghost")); err != nil {
		t.Fatalf("Put(member.ghost): %v", err)
	}
	mine := planned(P, "a", []string{"a", "ghost"}, "")
	if len(mine) != P/2 {
		t.Fatalf("Plan(a, [a ghost], all free) claims %v, want %d partitions", mine, P/2)
	}
	tr := newTracker(t)
	start := time.Now()
	r := startReplica(t, srv, "a", P, tr.work("a"), func(c *election.Config) { c.Grace = 500 * time.Millisecond })
	natstest.Eventually(t, 2*time.Second, ownedEquals(r, mine))
	quota := time.Since(start)
	natstest.Eventually(t, 3*time.Second, ownedEquals(r, all(P)))
	t.Logf("a's quota owned after %v, the ghost's after %v (Grace 500ms)", quota, time.Since(start))
	if d := time.Since(start); d < 500*time.Millisecond {
		t.Errorf("ghost's partitions claimed after %v, want ≥ Grace", d)
	}
	// They stay: no Work ends while the ghost is "alive" within the hold period.
	select {
	case e := <-tr.ends:
		t.Fatalf("Work ended %+v, want grace-claimed partitions kept", e)
	case <-time.After(2 * ttl):
	}
}

// TestServerRestart stops the server under a running replica for longer than the lease and
// starts it again: the replica must lose every lease by its own clock while the server is down
// (each Work ends with ErrLeaseLost), claim every partition again once reconnected (a new Work
// under a larger epoch), and then own each partition exactly once, its lease key held under the
// new claim.
func TestServerRestart(t *testing.T) {
	t.Parallel()
	const P = 4
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)
	tr := newTracker(t)
	r := startReplica(t, srv, "a", P, tr.work("a"))
	natstest.Eventually(t, 5*time.Second, ownedEquals(r, all(P)))
	tr.mu.Lock()
	before := maps.Clone(tr.epoch)
	tr.mu.Unlock()

	opts := *srv.Opts
	opts.Port = srv.Port()
	srv.Stop()
	stopped := time.Now()
	lost := map[int]bool{}
	for len(lost) < P {
		select {
		case e := <-tr.ends:
			if e.replica != "a" || !errors.Is(e.cause, election.ErrLeaseLost) {
				t.Fatalf("Work end %+v while the server is down, want replica a with ErrLeaseLost", e)
			}
			lost[e.partition] = true
		case <-time.After(5 * ttl):
			t.Fatalf("%d of %d leases lost within %v of stopping the server, want all", len(lost), P, 5*ttl)
		}
	}
	t.Logf("every lease lost %v after the server stopped", time.Since(stopped))
	srv = natstest.StartWith(t, &opts) // same port, same store: the replica reconnects on its own

	natstest.Eventually(t, 15*time.Second, func() error {
		if r.nc.Status() != nats.CONNECTED {
			return fmt.Errorf("connection %v", r.nc.Status())
		}
		if got := r.e.Owned(); !slices.Equal(got, all(P)) {
			return fmt.Errorf("Owned() = %v, want %v", got, all(P))
		}
		tr.mu.Lock()
		defer tr.mu.Unlock()
		for p := range P {
			if _, ok := tr.owner[p]; !ok || tr.epoch[p] <= before[p] {
				return fmt.Errorf("partition %d: running %v under epoch %d, want a Work under an epoch above %d", p, ok, tr.epoch[p], before[p])
			}
		}
		return nil
	})

	_, js = srv.JetStream(t)
	kv, err := js.KeyValue(context.Background(), bucket)
	if err != nil {
		t.Fatalf("KeyValue(%s): %v", bucket, err)
	}
	tr.mu.Lock()
	running, starts := maps.Clone(tr.epoch), maps.Clone(tr.starts)
	tr.mu.Unlock()
	t.Logf("epochs before the restart %v, after %v; Work starts %v", before, running, starts)
	for p := range P {
		ent, err := kv.Get(context.Background(), fmt.Sprintf("lease.%d", p))
		if err != nil {
			t.Fatalf("Get(lease.%d): %v", p, err)
		}
		if string(ent.Value()) != "a" || ent.Revision() < running[p] {
			t.Errorf("lease.%d = %q at revision %d, want held by a since its claim at epoch %d", p, ent.Value(), ent.Revision(), running[p])
		}
	}
	if err := r.stop(t); err != nil {
		t.Errorf("Run() = %v, want nil", err)
	}
}
