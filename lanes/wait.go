package lanes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/subjects"
)

// A lane that waits says what for. A partition whose publishes go unanswered, whose consumer
// delivers nothing, or that takes nothing new while its checkpoint cannot be written would
// otherwise be silent about it while it lasts (issue 34: 22 s without a line after a crashed
// server came back). Each lane runs a watcher beside its reader: it reads what the lane shows
// of itself (laneStats), and once a wait has lasted Config.WaitWarnAfter it logs which stream,
// which server and since when, shows it in [PartitionStats.Waiting] (kvmapper status, the
// kvmapper_partition_wait_seconds metric), warns again every waitRewarn while it lasts, and
// logs at Info when it ends.
//
// A consumer that delivers nothing is told apart from a partition with nothing to deliver by
// asking the stream's leader (kvcas.NextOf: $JS.API.STREAM.MSG.GET, which only the leader
// answers) for the partition's first message from the reader's position on, once the reader
// has been quiet for WaitWarnAfter, and again every WaitWarnAfter while it stays quiet: one
// small request per idle partition per interval. Such a consumer is replaced at once. It
// happens on a cluster: a lane's consumer has one replica, placed by the meta leader on any
// server of the stream's (nats-server 2.15 createGroupForConsumer prefers servers caught up
// with the meta group, not with the stream), and a server that has just restarted and is still
// catching up on the stream holds a consumer that sends heartbeats and none of the messages
// the leader has.

// Wait is what a lane has been waiting for, and since when.
type Wait struct {
	// For is what it waits for: WaitPublish, WaitConsumer, WaitWindow or WaitCheckpoint.
	For string
	// Stream is the stream it waits on: the output stream of its oldest publish in flight,
	// the partition's INCOMING stream, or the control bucket's stream. "" for WaitWindow.
	Stream string
	// Server is the server it waits on, when known: the stream's leader (WaitPublish), the
	// consumer's server (WaitConsumer). "" when none answered.
	Server string
	// Since is when the wait began.
	Since time.Time
}

// What a lane waits for ([Wait.For]).
const (
	// WaitPublish: its oldest publish in flight has no answer.
	WaitPublish = "publish"
	// WaitConsumer: its consumer delivers nothing while the stream's leader holds messages of
	// the partition the consumer has not delivered; the lane replaces it.
	WaitConsumer = "consumer"
	// WaitWindow: it takes nothing new because the pool's window (MaxInFlight,
	// MaxInFlightBytes) is full with the publishes of other partitions.
	WaitWindow = "window"
	// WaitCheckpoint: it takes nothing new because its checkpoint has not been written for
	// MaxCheckpointAge.
	WaitCheckpoint = "checkpoint"
)

// waitRewarn is how often a wait that goes on is logged again.
const waitRewarn = 10 * time.Second

// leaderAskTimeout bounds each request the watcher makes of a stream's leader.
const leaderAskTimeout = time.Second

// Why a lane takes nothing from its reader ([laneStats.gate]).
const (
	gateNone int32 = iota
	gateWindow
	gateCheckpoint
)

// errConsumerQuiet ends a consumer that delivers nothing while its stream holds messages for it.
var errConsumerQuiet = errors.New("lanes: the consumer delivers nothing while its stream's leader holds messages it has not delivered")

// waitStats are the parts of laneStats the watcher reads.
type waitStats struct {
	headSince  atomicTime             // when the oldest publish in flight became the oldest
	head       atomic.Int32           // its output stream: 0 OUTGOING, 1 UNMAPPED, 2 PARKED (streamOf)
	quietSince atomicTime             // the reader's last hand-on, or its consumer's creation
	consumer   atomic.Pointer[string] // the server of the reader's consumer
	gate       atomic.Int32           // gateNone, gateWindow, gateCheckpoint
	gateSince  atomicTime             // when gate last changed
	wait       atomic.Pointer[Wait]   // what the watcher found: nil while nothing is waited for
}

// atomicTime is a time.Time other goroutines read, to the nanosecond.
type atomicTime struct{ ns atomic.Int64 }

func (a *atomicTime) Store(t time.Time) { a.ns.Store(t.UnixNano()) }
func (a *atomicTime) Load() time.Time   { return time.Unix(0, a.ns.Load()) }

// loadString returns what p points to, "" for nil.
func loadString(p *atomic.Pointer[string]) string {
	if s := p.Load(); s != nil {
		return *s
	}
	return ""
}

// setGate records why the lane takes nothing new, when that changed; the lane's goroutine
// calls it once per round with what it found.
func (l *lane) setGate(g int32) {
	if l.stats.w.gate.Load() != g {
		l.stats.w.gate.Store(g)
		l.stats.w.gateSince.Store(time.Now())
	}
}

// noteHead records the output stream of the oldest publish in flight, and since when it is the
// oldest; the lane calls it when its head changes.
func (l *lane) noteHead() {
	if len(l.q) == 0 {
		return
	}
	l.stats.w.head.Store(int32(l.q[0].om.Stream))
	l.stats.w.headSince.Store(time.Now())
}

// outputName is the name of the lane's output stream i (streamOf).
func (l *lane) outputName(i int32) string {
	switch i {
	case 1:
		return l.p.cfg.Unmapped
	case 2:
		return l.p.cfg.Park.Stream
	}
	return l.p.cfg.Outgoing
}

// watchWaits is the lane's watcher (see the top of this file). It runs until ctx ends.
func (l *lane) watchWaits(ctx context.Context, replace chan<- struct{}) {
	after := l.p.cfg.WaitWarnAfter
	t := time.NewTicker(max(after/4, 10*time.Millisecond))
	defer t.Stop()
	var (
		cur       *Wait     // the wait going on, as stored in stats
		warned    time.Time // when cur was last logged; zero: not yet
		asked     time.Time // when the stream's leader was last asked about a quiet consumer
		quietNext uint64    // the reader's position when cur (a WaitConsumer) was found
	)
	defer l.stats.w.wait.Store(nil)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		w := l.waitNow(now, after)
		if w == nil && cur != nil && cur.For == WaitConsumer && l.stats.next.Load() == quietNext {
			w = cur // replaced, and the new consumer has not delivered yet: still waiting
		}
		if w == nil && l.stats.inFlight.Load() == 0 && l.stats.w.gate.Load() == gateNone &&
			now.Sub(l.stats.w.quietSince.Load()) >= after && now.Sub(asked) >= after {
			asked = now
			if next := l.stats.next.Load(); l.holdsUndelivered(ctx, next) {
				w = &Wait{For: WaitConsumer, Stream: l.stream, Server: loadString(&l.stats.w.consumer), Since: l.stats.w.quietSince.Load()}
				if cur != nil && cur.For == WaitConsumer {
					w.Since = cur.Since
				}
				quietNext = next
				select {
				case replace <- struct{}{}:
				default:
				}
			}
		}
		switch {
		case w == nil:
			if cur != nil && !warned.IsZero() {
				l.log.Info().Str("waited_for", cur.For).Str("stream", cur.Stream).
					Int64("waited_ms", now.Sub(cur.Since).Milliseconds()).Msg("partition moving again")
			}
			if cur != nil {
				l.stats.w.wait.Store(nil)
			}
			cur, warned = nil, time.Time{}
			continue
		case cur == nil || w.For != cur.For || w.Stream != cur.Stream:
			cur, warned = w, time.Time{}
		default:
			cur.Server = cmp.Or(w.Server, cur.Server)
			w = cur
		}
		if now.Sub(cur.Since) < after {
			continue
		}
		if warned.IsZero() || now.Sub(warned) >= waitRewarn {
			if cur.For == WaitPublish {
				cur.Server = l.leaderOf(ctx, cur.Stream)
			}
			warned = now
			l.warnWait(cur, now)
		}
		l.stats.w.wait.Store(&Wait{For: cur.For, Stream: cur.Stream, Server: cur.Server, Since: cur.Since})
	}
}

// waitNow returns what the lane has waited for longer than after, from what it shows of itself:
// its oldest publish in flight, or a gate; nil when neither.
func (l *lane) waitNow(now time.Time, after time.Duration) *Wait {
	if l.stats.inFlight.Load() > 0 {
		if since := l.stats.w.headSince.Load(); now.Sub(since) >= after {
			return &Wait{For: WaitPublish, Stream: l.outputName(l.stats.w.head.Load()), Since: since}
		}
		return nil
	}
	since := l.stats.w.gateSince.Load()
	if now.Sub(since) < after {
		return nil
	}
	switch l.stats.w.gate.Load() {
	case gateWindow:
		return &Wait{For: WaitWindow, Since: since}
	case gateCheckpoint:
		return &Wait{For: WaitCheckpoint, Stream: subjects.BucketStream(l.p.ctl.Bucket()), Since: since}
	}
	return nil
}

// holdsUndelivered asks the leader of the lane's stream whether it holds a message of the
// partition at sequence next or later, stored a while ago: one the reader should have handed on
// by now. No answer is no.
func (l *lane) holdsUndelivered(ctx context.Context, next uint64) bool {
	ctx, cancel := context.WithTimeout(ctx, leaderAskTimeout)
	defer cancel()
	m, err := kvcas.NextOf(ctx, l.p.js, l.stream, cmp.Or(l.filter, ">"), next)
	// Stored a moment ago, it may be on its way to the reader: only one stored a while before
	// counts (the servers' clock against this one's, which a cluster keeps close).
	return err == nil && time.Since(m.Time) >= l.p.cfg.WaitWarnAfter/2
}

// leaderOf returns the name of stream's leader, "" when none answered in time.
func (l *lane) leaderOf(ctx context.Context, stream string) string {
	ctx, cancel := context.WithTimeout(ctx, leaderAskTimeout)
	defer cancel()
	s, err := l.p.js.Stream(ctx, stream)
	if err != nil {
		return ""
	}
	if ci := s.CachedInfo().Cluster; ci != nil {
		return ci.Leader
	}
	return ""
}

// warnWait logs w, which has lasted since w.Since, with what to do about it.
func (l *lane) warnWait(w *Wait, now time.Time) {
	l.p.warn("wait", func(e *zerolog.Event) {
		e = e.Int("partition", l.a.Partition).Str("waiting_for", w.For).Int64("waited_ms", now.Sub(w.Since).Milliseconds()).
			Time("since", w.Since)
		if w.Stream != "" {
			e = e.Str("stream", w.Stream)
		}
		if w.Server != "" {
			e = e.Str("server", w.Server)
		}
		switch w.For {
		case WaitPublish:
			where := "its leader " + w.Server
			if w.Server == "" {
				where = "no leader answered: it may be electing one"
			}
			e.Msg(fmt.Sprintf("partition waits for %s to store its publishes (%s); the lane resends on its own; if this lasts, see `nats stream info %s`", w.Stream, where, w.Stream))
		case WaitConsumer:
			e.Msg(fmt.Sprintf("partition's consumer on %s (server %s) delivers nothing while the stream's leader holds messages for it; replacing it (a server still catching up after a restart can hold such a consumer)", w.Stream, w.Server))
		case WaitWindow:
			e.Msg("partition takes nothing new: the replica's in-flight window (--max-in-flight) is full with other partitions' publishes, which wait for their streams")
		case WaitCheckpoint:
			e.Msg(fmt.Sprintf("partition takes nothing new until its checkpoint is written to %s; see the checkpoint warnings and `nats stream info %s`", w.Stream, w.Stream))
		}
	})
}
