package lanes

import (
	"testing"
	"testing/synctest"
	"time"
)

// The lease clock is read once per burst of checks: at most once per leaseReuse of Go's
// monotonic clock and per leaseReuseMsgs publishes or leaseReuseBytes of them; a reading that
// said the lease is lost is never reused.
func TestLeaseClockReuse(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		reads, ok := 0, true
		c := leaseClock{valid: func() bool { reads++; return ok }}

		for i := range 10 * leaseReuseMsgs {
			if !c.publish(100) {
				t.Fatalf("publish %d = false, want true", i)
			}
		}
		if reads != 10 {
			t.Fatalf("%d publishes read the clock %d times, want 10 (once per %d)", 10*leaseReuseMsgs, reads, leaseReuseMsgs)
		}

		reads = 0
		for range 3 * leaseReuseMsgs {
			c.holds()
		}
		if reads != 0 {
			t.Fatalf("holds read the clock %d times within %v of a reading, want 0", reads, leaseReuse)
		}
		time.Sleep(leaseReuse) // the scenario, not a synchronisation: the reading must grow old
		c.holds()
		if reads != 1 {
			t.Fatalf("holds read the clock %d times %v after the last reading, want 1", reads, leaseReuse)
		}
		time.Sleep(leaseReuse) // the scenario, not a synchronisation: the reading must grow old
		c.publish(1)
		if reads != 2 {
			t.Fatalf("publish read the clock %d times in all, want 2: the reading was %v old", reads, leaseReuse)
		}

		reads = 0
		c.publish(leaseReuseBytes) // more than is left of the reading's bytes
		c.publish(leaseReuseBytes)
		if reads != 2 {
			t.Fatalf("two publishes of %d bytes read the clock %d times, want 2 (at most %d bytes per reading)", leaseReuseBytes, reads, leaseReuseBytes)
		}

		reads, ok = 0, false
		time.Sleep(leaseReuse) // the scenario, not a synchronisation: the reading must grow old
		if c.publish(1) || c.holds() || c.publish(1) {
			t.Fatal("the lease holds after the clock said it is lost")
		}
		if reads != 3 {
			t.Fatalf("three checks after a lost reading read the clock %d times, want 3 (a lost reading is never reused)", reads)
		}
	})
}

// A lane with no lease clock never reads one.
func TestLeaseClockNone(t *testing.T) {
	t.Parallel()
	var c leaseClock
	if !c.holds() || !c.publish(1<<30) {
		t.Fatal("a lease without a clock does not hold")
	}
}
