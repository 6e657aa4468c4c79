package lanes

import "time"

// A lane checks its lease ([Assignment.Valid]) before every publish and at the top of its loop.
// The lease clock is CLOCK_BOOTTIME on Linux, read with a system call (about 0.4µs here, where
// Go's monotonic clock costs 35ns through the vDSO): read per check, it took 12% of the
// replica's CPU. So a lane reads it at most once per leaseReuse of Go's monotonic clock, and
// per leaseReuseMsgs publishes or leaseReuseBytes of them, whichever comes first, and answers
// the checks in between from that reading.
//
// What that lets slip past the lease, and why it is no worse than the gap between a check and
// its publish that there always was (I3):
//   - The lease running out while the lane runs: the lane notices it at most leaseReuse late.
//     Its lease clock runs out Margin (250ms by default) before the server's lease can expire,
//     so that 1ms is far inside the margin: no one else can own the partition yet. A check
//     made just before a publish never ruled out a publish written to the socket later than
//     that either (preemption, a GC pause).
//   - A stopped process (SIGSTOP, a frozen cgroup, a long GC): Go's monotonic clock counts the
//     stop, so the first check after it reads the lease clock again, which counts it too, and
//     the lane publishes nothing more. What slips past is what it slipped past before: the
//     publishes already in nats.go's write buffer (32 KiB) when the process stopped.
//   - A suspended machine: Go's monotonic clock does not count the suspend, so a reading taken
//     just before it still answers after the resume, for at most leaseReuseMsgs publishes and
//     leaseReuseBytes; then the lane reads the lease clock, which counts the suspend, and
//     stops. Before, what slipped past a suspend was what had passed its check and was still in
//     nats.go's write buffer (up to 32 KiB) or the kernel's socket buffer (tens of KiB or more):
//     this adds at most one more nats.go buffer's worth. It is the same hazard, of the same
//     size: a deposed owner's late publishes, which OUTGOING drops as duplicates when the new
//     owner stored them first.
const (
	leaseReuse      = time.Millisecond
	leaseReuseMsgs  = 64
	leaseReuseBytes = 32 << 10
)

// leaseClock caches readings of a lane's lease clock for the lane's goroutine (it is not safe
// for concurrent use).
type leaseClock struct {
	valid func() bool // Assignment.Valid; nil: the lease never runs out
	ok    bool        // what the last reading said
	at    time.Time   // when it was taken, by Go's monotonic clock
	msgs  int         // publishes the reading may still answer for
	bytes int64       // bytes of publishes it may still answer for
}

// read reads the lease clock.
func (c *leaseClock) read(now time.Time) bool {
	c.ok = c.valid()
	c.at, c.msgs, c.bytes = now, leaseReuseMsgs, leaseReuseBytes
	return c.ok
}

// holds reports whether the lease holds, from a reading younger than leaseReuse.
func (c *leaseClock) holds() bool {
	if c.valid == nil {
		return true
	}
	now := time.Now()
	if c.ok && now.Sub(c.at) < leaseReuse {
		return true
	}
	return c.read(now)
}

// publish reports whether the lease holds for one publish of size bytes, and counts it against
// the reading that answers.
func (c *leaseClock) publish(size int64) bool {
	if c.valid == nil {
		return true
	}
	now := time.Now()
	if !c.ok || now.Sub(c.at) >= leaseReuse || c.msgs <= 0 || c.bytes < size {
		if !c.read(now) {
			return false
		}
	}
	c.msgs--
	c.bytes -= size
	return true
}
