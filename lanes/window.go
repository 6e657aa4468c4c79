package lanes

import "sync"

// window is the pool's bound on publishes in flight (I5), in messages and in bytes, shared by
// its lanes so that one hot or stuck partition cannot stall the others.
//
// Each partition is guaranteed a small part of the window, a quarter of an even split
// (MaxInFlight / 4P messages, MaxInFlightBytes / 4P bytes), whether its lane runs or not: what
// the other partitions have not used of their guarantee is never lent out. The rest is shared:
// a lane takes what is free, except that a lane holding its even share of the running lanes
// (or more) takes nothing while another lane waits. So a lone busy lane gets all but the other
// partitions' guarantees (about 77% of the window with 16 partitions), busy lanes converge on
// even shares, and a lane whose publishes go unanswered, which keeps what it holds through
// every retry, can never hold the guarantee of another.
//
// The guarantee is not lent out because it could not be taken back: a publish on the wire
// stays in flight until the server answers, and only resending it (after its timeout) would
// tell. A lane with nothing in flight may always send one message, even one larger than the
// bytes left: otherwise a message larger than a lane's guarantee could wait forever behind
// stuck lanes. The bytes in flight can so exceed MaxInFlightBytes by at most one message per
// lane, and only with messages larger than MaxInFlightBytes / 4P.
type window struct {
	mu                  sync.Mutex
	maxMsgs, maxBytes   int64
	freeMsgs, freeBytes int64
	// resMsgs and resBytes are what the partitions are still owed of their guarantees: free
	// never drops below them (but by the one-message allowance above).
	resMsgs, resBytes int64
	gMsgs, gBytes     int64 // each partition's guarantee
	partitions        int
	lanes             int      // lanes registered
	waiters           []*grant // lanes refused room, each woken on every release
}

// grant is what a lane holds of the window; it is guarded by the window's mutex.
type grant struct {
	msgs, bytes int64
	waiting     bool
	wake        chan struct{} // capacity 1: a release happened since the lane last looked
}

func newWindow(msgs, bytes int64, partitions int) *window {
	w := &window{
		maxMsgs: msgs, maxBytes: bytes,
		freeMsgs: msgs, freeBytes: bytes,
		gMsgs:      msgs / int64(4*partitions),
		gBytes:     bytes / int64(4*partitions),
		partitions: partitions,
	}
	w.gMsgs = max(w.gMsgs, 1)
	w.resMsgs = int64(partitions) * w.gMsgs
	w.resBytes = int64(partitions) * w.gBytes
	return w
}

// owed is what a lane holding g is still owed of its guarantee.
func (w *window) owed(msgs, bytes int64) (int64, int64) {
	return max(0, w.gMsgs-msgs), max(0, w.gBytes-bytes)
}

func (w *window) register() {
	w.mu.Lock()
	w.lanes++
	if w.lanes > w.partitions {
		// Two lanes of one partition (one stopping, one starting): the newcomer is owed its
		// guarantee too.
		w.resMsgs += w.gMsgs
		w.resBytes += w.gBytes
	}
	w.mu.Unlock()
}

// unregister removes a lane that holds nothing.
func (w *window) unregister(g *grant) {
	w.mu.Lock()
	if w.lanes > w.partitions {
		w.resMsgs -= w.gMsgs
		w.resBytes -= w.gBytes
	}
	w.lanes--
	w.setWaiting(g, false)
	w.mu.Unlock()
}

// take reserves room for one message of size bytes for the lane holding g, and reports whether
// it could. A lane refused is woken (on g.wake) whenever room is given back.
func (w *window) take(g *grant, size int64) bool {
	w.mu.Lock()
	ok := w.fits(g, size)
	if ok {
		ownM, ownB := w.owed(g.msgs, g.bytes)
		g.msgs++
		g.bytes += size
		w.freeMsgs--
		w.freeBytes -= size
		afterM, afterB := w.owed(g.msgs, g.bytes)
		w.resMsgs -= ownM - afterM
		w.resBytes -= ownB - afterB
	}
	w.setWaiting(g, !ok)
	w.mu.Unlock()
	return ok
}

func (w *window) fits(g *grant, size int64) bool {
	if w.freeMsgs < 1 {
		return false
	}
	ownM, ownB := w.owed(g.msgs, g.bytes)
	afterM, afterB := w.owed(g.msgs+1, g.bytes+size)
	// After taking, what is free must still cover what every other partition is owed.
	if w.freeMsgs-1 < w.resMsgs-ownM+afterM {
		return false
	}
	if g.msgs > 0 && w.freeBytes-size < w.resBytes-ownB+afterB {
		return false
	}
	others := len(w.waiters)
	if g.waiting {
		others--
	}
	if others > 0 {
		n := int64(max(w.lanes, 1))
		if g.msgs >= w.maxMsgs/n || g.bytes >= w.maxBytes/n {
			return false // at its share while another lane waits
		}
	}
	return true
}

// give returns room for msgs messages of bytes in all, and wakes the lanes waiting for room.
func (w *window) give(g *grant, msgs, bytes int64) {
	if msgs == 0 {
		return
	}
	w.mu.Lock()
	ownM, ownB := w.owed(g.msgs, g.bytes)
	g.msgs -= msgs
	g.bytes -= bytes
	w.freeMsgs += msgs
	w.freeBytes += bytes
	afterM, afterB := w.owed(g.msgs, g.bytes)
	w.resMsgs += afterM - ownM
	w.resBytes += afterB - ownB
	for _, o := range w.waiters {
		select {
		case o.wake <- struct{}{}:
		default:
		}
	}
	w.mu.Unlock()
}

func (w *window) setWaiting(g *grant, waiting bool) {
	if g.waiting == waiting {
		return
	}
	g.waiting = waiting
	if waiting {
		w.waiters = append(w.waiters, g)
		return
	}
	for i, o := range w.waiters {
		if o == g {
			w.waiters[i] = w.waiters[len(w.waiters)-1]
			w.waiters[len(w.waiters)-1] = nil
			w.waiters = w.waiters[:len(w.waiters)-1]
			break
		}
	}
}

// inFlight returns the messages and bytes in flight in all lanes.
func (w *window) inFlight() (msgs, bytes int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.maxMsgs - w.freeMsgs, w.maxBytes - w.freeBytes
}
