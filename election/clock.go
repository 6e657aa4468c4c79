package election

import "time"

// monoClock returns a lease clock that reads Go's monotonic clock: the time since the call.
// On Linux that clock is CLOCK_MONOTONIC, which stops while the machine is suspended.
func monoClock() func() time.Duration {
	origin := time.Now()
	return func() time.Duration { return time.Since(origin) }
}
