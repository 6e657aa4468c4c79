package lanes

import (
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// A stream's leader that steps down (its server stopping gracefully, a step-down) drops the
// publishes it had queued, and its successor never sees them: their answers never come. A lane
// finds out when a later publish is stored first (see overtaken), or after StallTimeout without
// any answer. The server announces each new leader at once on
// $JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.<stream>: the pool listens, and a lane takes a
// publish to an output stream for lost when it is still unanswered leaderGrace after that
// stream's new leader was announced, although it was sent before (see expire).

// leaderElectedPrefix starts the subjects of nats-server's stream leader advisories.
const leaderElectedPrefix = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED."

// leaderGrace is how long after a new leader of its stream was announced a publish sent before
// may still be answered (the old leader stored it and answered late, or the new one had it).
const leaderGrace = 100 * time.Millisecond

// leaders records when each stream's latest leader was announced. Its subscription lives while
// any lane runs.
type leaders struct {
	mu    sync.Mutex
	lanes int
	sub   *nats.Subscription
	at    map[string]time.Time
}

// start subscribes to the advisories for the first running lane. A failure leaves the lanes to
// their timeouts; the connection's error handler logs a refused subscription.
func (ls *leaders) start(nc *nats.Conn) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.lanes++; ls.lanes > 1 {
		return
	}
	if ls.at == nil {
		ls.at = make(map[string]time.Time)
	}
	sub, err := nc.Subscribe(leaderElectedPrefix+"*", func(m *nats.Msg) {
		stream := strings.TrimPrefix(m.Subject, leaderElectedPrefix)
		ls.mu.Lock()
		ls.at[stream] = time.Now()
		ls.mu.Unlock()
	})
	if err == nil {
		ls.sub = sub
	}
}

// stop unsubscribes when the last lane stops.
func (ls *leaders) stop() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.lanes--; ls.lanes > 0 || ls.sub == nil {
		return
	}
	_ = ls.sub.Unsubscribe()
	ls.sub = nil
}

// elected returns when stream's latest leader was announced, zero if none was since the pool's
// first lane started.
func (ls *leaders) elected(stream string) time.Time {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.at[stream]
}

// stoppingFor is how long a server that said it is shutting down is taken for gone: the meta
// leader learns of the stop a moment later (the server's shutdown event follows its 409s within
// milliseconds), and places no consumer there after. Not longer: in a rolling restart the same
// server is back, and a good place for consumers, seconds later.
const stoppingFor = time.Second

// stopped records that server host said it is shutting down (409 Server Shutdown to a lane's
// pull request).
func (p *Pool) stopped(host string) {
	if host == "" {
		return
	}
	p.stopMu.Lock()
	defer p.stopMu.Unlock()
	if p.stops == nil {
		p.stops = make(map[string]time.Time)
	}
	p.stops[host] = time.Now()
}

// stopping reports whether server host said it is shutting down within stoppingFor.
func (p *Pool) stopping(host string) bool {
	if host == "" {
		return false
	}
	p.stopMu.Lock()
	defer p.stopMu.Unlock()
	at, ok := p.stops[host]
	return ok && time.Since(at) < stoppingFor
}
