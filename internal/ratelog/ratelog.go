// Package ratelog keeps a flood of one kind of problem (bad input, a missing permission) from
// flooding the log: a [Limiter] allows one line per interval for each kind and counts the lines
// it held back, so that the next line can say how many there were. It only decides; logging is
// left to the caller.
package ratelog

import (
	"sync"
	"time"
)

// Limiter allows one event per Every for each kind. The zero value allows one per second. It is
// safe for concurrent use.
type Limiter struct {
	// Every is the least time between two allowed events of one kind. Default 1s.
	Every time.Duration

	mu   sync.Mutex
	last map[string]time.Time
	skip map[string]int
}

// Allow reports whether an event of kind may be logged now and, if so, how many were held back
// since the last one that was.
func (l *Limiter) Allow(kind string) (suppressed int, ok bool) { return l.AllowAt(kind, time.Now()) }

// AllowAt is [Limiter.Allow] at the time now.
func (l *Limiter) AllowAt(kind string, now time.Time) (suppressed int, ok bool) {
	every := l.Every
	if every == 0 {
		every = time.Second
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil {
		l.last, l.skip = map[string]time.Time{}, map[string]int{}
	}
	if last, seen := l.last[kind]; seen && now.Sub(last) < every {
		l.skip[kind]++
		return 0, false
	}
	n := l.skip[kind]
	l.last[kind], l.skip[kind] = now, 0
	return n, true
}
