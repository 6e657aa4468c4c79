//go:build linux

package election

import (
	"time"

	"golang.org/x/sys/unix"
)

// bootClock returns the default lease clock. On Linux it reads CLOCK_BOOTTIME, which counts
// the time the machine spent suspended as well, so that an owner resuming from a suspend finds
// its leases expired. Each reading is a system call (about 0.3µs; the monotonic clock takes
// 25ns through the vDSO). Should the kernel refuse CLOCK_BOOTTIME (it has had it since 2.6.39),
// it falls back to Go's monotonic clock.
func bootClock() func() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return monoClock()
	}
	return func() time.Duration {
		var ts unix.Timespec
		// It cannot fail once it has succeeded: the clock id and the pointer are valid.
		_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts)
		return time.Duration(ts.Nano())
	}
}
