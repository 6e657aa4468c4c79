package election_test

import (
	"context"
	"errors"
	"fmt"
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
	f := <-failed
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

// TestServerRestart restarts the server under a running replica: it loses its leases by its
// own clock while disconnected, and owns every partition again once reconnected.
func TestServerRestart(t *testing.T) {
	const P = 4
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)
	tr := newTracker(t)
	r := startReplica(t, srv, "a", P, tr.work("a"))
	natstest.Eventually(t, 5*time.Second, ownedEquals(r, all(P)))
	_ = r.nc // reconnects on its own
	srv.Restart()
	natstest.Eventually(t, 15*time.Second, func() error {
		if got := r.e.Owned(); !slices.Equal(got, all(P)) {
			return fmt.Errorf("Owned() = %v, want %v (connection %v)", got, all(P), r.nc.Status())
		}
		if r.nc.Status() != nats.CONNECTED {
			return fmt.Errorf("connection %v", r.nc.Status())
		}
		tr.mu.Lock()
		defer tr.mu.Unlock()
		if len(tr.owner) != P {
			return fmt.Errorf("%d Works running, want %d", len(tr.owner), P)
		}
		return nil
	})
	tr.mu.Lock()
	t.Logf("Work starts per partition after the restart: %v", tr.starts)
	tr.mu.Unlock()
	if err := r.stop(t); err != nil {
		t.Errorf("Run() = %v, want nil", err)
	}
}
