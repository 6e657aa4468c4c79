//go:build linux

package election_test

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmapper/kvmapper/election"
)

// TestBootClockIsBoottime checks that on Linux the default lease clock reads CLOCK_BOOTTIME,
// the clock that counts time suspended, and not a fallback.
func TestBootClockIsBoottime(t *testing.T) {
	t.Parallel()
	clock := election.BootClock()
	var before, after unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &before); err != nil {
		t.Fatalf("ClockGettime(CLOCK_BOOTTIME): %v", err)
	}
	got := clock()
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &after); err != nil {
		t.Fatalf("ClockGettime(CLOCK_BOOTTIME): %v", err)
	}
	lo, hi := time.Duration(before.Nano()), time.Duration(after.Nano())
	if got < lo || got > hi {
		t.Errorf("clock() = %v, want between CLOCK_BOOTTIME readings %v and %v", got, lo, hi)
	}
}
