package election_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// TestSuspendEndsLease makes the lease clock jump past the lease, which is what a suspended
// machine sees when it resumes, while Go's monotonic clock barely moves: the lease must turn
// invalid at once and the partition's context end with ErrLeaseLost, well before the lease
// could run out by the monotonic clock (it is renewed all along).
func TestSuspendEndsLease(t *testing.T) {
	t.Parallel()
	const leaseTTL = 3 * time.Second // renewals every 750ms, margin 250ms
	var suspended atomic.Int64
	origin := time.Now()
	clock := func() time.Duration { return time.Since(origin) + time.Duration(suspended.Load()) }

	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)
	type ended struct {
		cause error
		at    time.Time
	}
	leases := make(chan *election.Lease, 4)
	ends := make(chan ended, 4)
	r := startReplica(t, srv, "a", 1, func(ctx context.Context, l *election.Lease) error {
		leases <- l
		<-ctx.Done()
		ends <- ended{context.Cause(ctx), time.Now()}
		return nil
	}, func(c *election.Config) { c.LeaseTTL = leaseTTL; c.Clock = clock })
	var l *election.Lease
	select {
	case l = <-leases:
	case <-time.After(10 * time.Second):
		t.Fatalf("partition 0 not claimed within 10s")
	}
	if !l.Valid() {
		t.Fatalf("Lease.Valid() = false before the jump")
	}

	resumed := time.Now()
	suspended.Store(int64(10 * leaseTTL))
	if l.Valid() {
		t.Errorf("Lease.Valid() = true right after the lease clock jumped %v", 10*leaseTTL)
	}
	select {
	case e := <-ends:
		if !errors.Is(e.cause, election.ErrLeaseLost) {
			t.Errorf("Work cause = %v, want ErrLeaseLost", e.cause)
		}
		d := e.at.Sub(resumed)
		t.Logf("context ended %v after the jump (monotonic)", d)
		if d >= leaseTTL-250*time.Millisecond {
			t.Errorf("context ended %v after the jump, want well before the lease could run out by the monotonic clock", d)
		}
	case <-time.After(2 * leaseTTL):
		t.Fatalf("Work still running %v after the lease clock jumped past the lease", 2*leaseTTL)
	}
	if err := r.stop(t); err != nil {
		t.Errorf("Run() = %v, want nil", err)
	}
}

// TestBootClockAdvancesWithMonotonic checks that the default lease clock advances, never goes
// back, and over a short interval (in which the machine is not suspended) agrees with Go's
// monotonic clock.
func TestBootClockAdvancesWithMonotonic(t *testing.T) {
	t.Parallel()
	clock := election.BootClock()
	b0, m0 := clock(), time.Now()
	prev := b0
	for range 1000 {
		if now := clock(); now < prev {
			t.Fatalf("clock() = %v after %v, want never backwards", now, prev)
		} else {
			prev = now
		}
	}
	// Not a synchronisation: the interval to compare the clocks over.
	<-time.After(200 * time.Millisecond)
	m1 := time.Now()
	b1 := clock()
	boot, mono := b1-b0, m1.Sub(m0)
	t.Logf("over %v of monotonic time the lease clock advanced %v", mono, boot)
	if boot < mono-time.Millisecond || boot > mono+50*time.Millisecond {
		t.Errorf("lease clock advanced %v while the monotonic clock advanced %v, want about the same", boot, mono)
	}
}
