package bench

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// progress keeps one line of status on a terminal, redrawn at most ten times a second.
// Its methods are safe for concurrent use and do nothing when it writes nowhere.
type progress struct {
	w     io.Writer
	mu    sync.Mutex
	last  time.Time
	shown bool
}

func newProgress(w io.Writer) *progress { return &progress{w: w} }

func (p *progress) show(format string, a ...any) {
	if p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.last) < 100*time.Millisecond {
		return
	}
	p.last = time.Now()
	p.shown = true
	fmt.Fprintf(p.w, "\r\033[K"+format, a...)
}

func (p *progress) clear() {
	if p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shown {
		fmt.Fprint(p.w, "\r\033[K")
		p.shown = false
	}
}
