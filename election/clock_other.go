//go:build !linux

package election

import "time"

// bootClock returns the default lease clock. Outside Linux it is Go's monotonic clock, which
// on some systems (macOS among them) does not count the time the machine spent asleep.
func bootClock() func() time.Duration { return monoClock() }
