package lanes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

// read consumes the lane's partition from its stream (INCOMING filtered, or INCOMING-<p>) in
// stream order, starting at sequence next, and hands each message to out until ctx is done. It
// reads through one consumer at a time (see [lane.consume]), each from the sequence after the
// last it handed on; when one fails — a gap, a missed heartbeat (its server died), a consumer
// deleted, a reconnect that lost it, a refused request, a creation nobody answered — it creates
// the next at once, and after a failure that read nothing since the one before, with backoff and
// a warning.
func (l *lane) read(ctx context.Context, next uint64, out chan<- delivery) {
	backoff := l.p.cfg.RetryBackoff
	create, timeouts := consumerCreateTimeout, 0
	var failed time.Time // when the last consumer failed
	for ctx.Err() == nil {
		from := next
		err := l.consume(ctx, &next, out, create)
		switch {
		case errors.Is(err, jetstream.ErrServerShutdown), errors.Is(err, errOnStoppingServer):
			// The consumer's server is stopping. The next consumer may be placed on it again (the
			// meta leader learns of the stop a moment later), and its creation then goes
			// unanswered: give up on it soon.
			create, timeouts = shutdownCreateTimeout, 0
		case errors.Is(err, errCreateTimedOut) && create == shutdownCreateTimeout:
			create, timeouts = consumerCreateTimeout, 0
		case errors.Is(err, errCreateTimedOut):
			// One lost creation is a dead server's; a few in a row, most often a meta leader
			// that died with it (see consumerCreateTimeout); many, a cluster slow to answer,
			// which is not to be asked ever faster: after the third, each waits twice as
			// long, up to maxConsumerCreateTimeout.
			if timeouts++; timeouts > 2 {
				create = min(2*create, maxConsumerCreateTimeout)
			}
		case err == nil || next != from:
			create, timeouts = consumerCreateTimeout, 0
		}
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errConsumerQuiet) {
			// The lane's watcher found it delivering nothing and warned: the next at once.
			continue
		}
		if errors.Is(err, ErrIncomingRecreated) {
			select {
			case l.readErr <- err: // the lane stops on it
			case <-ctx.Done():
			}
			return
		}
		now := time.Now()
		if next != from || now.Sub(failed) > l.p.cfg.MaxRetryBackoff {
			// It read since the last failure, or that was long ago: the reset an ordered
			// consumer makes after a gap or a reconnect, made at once and quietly.
			failed, backoff = now, l.p.cfg.RetryBackoff
			l.log.Debug().Err(err).Uint64("next", next).Msg("consumer reset")
			continue
		}
		failed = now
		l.p.warn("consume", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Err(err).Uint64("next", next).
				Str("stream", l.stream).Msg("consuming INCOMING failed; retrying (on a cluster this is expected for a few seconds after a server died; if it persists, check that the stream exists: kvmapper setup)")
		})
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
		backoff = min(2*backoff, l.p.cfg.MaxRetryBackoff)
	}
}

// errGap marks a consumer that skipped a delivery: a message lost on the way (a reconnect, a
// slow subscription), which the next consumer reads again.
var errGap = errors.New("lanes: a delivery is missing (consumer sequence gap)")

// consumerCreateTimeout bounds the creation of a lane's consumer at first. On a cluster, the
// meta leader takes a crashed server for offline only once its heartbeats have been missing for
// minutes (nats-server 2.15 events.go, orphMax = 5 × 30s), and may place a consumer created
// meanwhile on that server, which never answers: the lane gives up on it after this and creates
// another, under another name, placed again. A creation is answered by the meta leader alone,
// and until the other servers notice that it died (their election timers, seconds) nobody
// answers at all: every creation sent meanwhile is lost, and the first one sent after the next
// meta leader is elected is answered at once. So a lane's wait past that election is at most
// one creation's timeout, and that is kept short: the first three creations in a row that
// time out wait 2 s each, the next ones twice as long, but never past maxConsumerCreateTimeout
// (4 s), so that a cluster merely slow to answer is not asked ever faster, and a lane does not
// wait 8-10 s more than its cluster did (a clean-clone CI run on 2026-12-07: a message waited
// 16.1 s after the server leading INCOMING, OUTGOING and, most likely, the meta group was
// killed; the next meta leader was logged 8.6 s after the kill, by when the lane's creation
// timeouts had grown to 8 s). (nats.go's ordered consumer waits 10s per attempt and, by
// default, retries the same name for ever.)
//
// After a consumer's server said it is shutting down (409 Server Shutdown, which nats-server
// sends the pending pull requests of its one-replica consumers before it stops), the next
// creation waits shutdownCreateTimeout only: the meta leader may place the new consumer on the
// stopping server before it learns of the stop, and that creation is never answered.
const (
	consumerCreateTimeout    = 2 * time.Second
	maxConsumerCreateTimeout = 4 * time.Second
	shutdownCreateTimeout    = 300 * time.Millisecond
)

// errOnStoppingServer reports a consumer created on a server that has said it is shutting down.
var errOnStoppingServer = errors.New("lanes: the consumer was placed on a server that is shutting down")

// errCreateTimedOut reports a consumer creation that got no answer in time.
var errCreateTimedOut = errors.New("lanes: no answer to the creation of a consumer")

// resetAttempts is how many times an ordered consumer (a parked device's drain reads through
// one) tries to recreate itself after a reset before its iterator fails. nats.go's default is
// for ever, under one name: on a cluster, a consumer recreated within seconds of a server's
// crash can be placed on that server (see consumerCreateTimeout), and every attempt at that
// name then waits for an answer that never comes. A new ordered consumer has a new name.
const resetAttempts = 1

// consumerInactive is how long the server keeps a lane's consumer that nobody reads, when the
// lane could not delete it (its process died).
const consumerInactive = time.Minute

// consume creates one consumer on the lane's stream from *next on — ephemeral, unacknowledged,
// in memory, one replica, as nats.go's ordered consumer makes them — reads it and hands its
// messages to out, in order, until ctx is done (it returns nil) or the consumer fails (it
// returns why; read then creates the next from *next). It deletes the consumer before it
// returns. One at a time: the next consumer is created only once this one's callback can hand
// nothing on any more, so two consumers' messages never race for the feed. (nats.go's
// ordered consumer recreates itself while a callback of the consumer it replaces may still be
// waiting for the feed, and a later message of the new one can then overtake it.) Every
// consumer has a name of its own: on a cluster, a consumer created within seconds of a server's
// crash can be placed on that server (see [consumerCreateTimeout]), and a create under a name
// placed there waits for an answer that never comes; the creation gives up after
// createTimeout.
//
// The messages come to a Consume callback on the subscription's own goroutine, which blocks
// while the feed is full: the consumer then sends no new pull request (nats.go asks again
// only once the callback has returned for every message of the last one), so it holds at most
// one request's worth, PullBatch messages and pullBytes bytes. A callback costs one allocation
// per message where the iterator's Next cost five (its options, a heartbeat monitor, its timer
// and closure, the message wrapper: BENCHMARKS-fastbatch.md, section 3).
func (l *lane) consume(ctx context.Context, next *uint64, out chan<- delivery, createTimeout time.Duration) error {
	cfg := jetstream.ConsumerConfig{
		// kvmapper_<p>_<random>: the partition shows in `nats consumer ls`.
		Name:              "kvmapper_" + strconv.Itoa(l.a.Partition) + "_" + strings.TrimPrefix(nats.NewInbox(), nats.InboxPrefix),
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       *next,
		AckPolicy:         jetstream.AckNonePolicy,
		InactiveThreshold: consumerInactive,
		Replicas:          1,
		MemoryStorage:     true,
		// One filter subject: a filtered read walks the stream, and more filters cost more.
		FilterSubject: l.filter,
	}
	cctx, cancel := context.WithTimeout(ctx, createTimeout)
	cons, err := l.p.js.CreateConsumer(cctx, l.stream, cfg)
	timedOut := cctx.Err() != nil && ctx.Err() == nil
	cancel()
	// Also when the create timed out: it may have been applied after all. In the background:
	// the delete of a consumer whose server has just stopped waits seconds for an answer, and
	// the next consumer must not wait for it.
	defer l.deletes.Go(func() { l.deleteConsumer(cfg.Name) })
	if err != nil && timedOut {
		return fmt.Errorf("%w on %s within %v: %w", errCreateTimedOut, l.stream, createTimeout, err)
	}
	if err != nil {
		return fmt.Errorf("creating a consumer on %s: %w", l.stream, err)
	}
	var host string
	if ci := cons.CachedInfo(); ci != nil && ci.Cluster != nil {
		host = ci.Cluster.Leader
	}
	// On one server, the consumer is where the lane is connected (what the watcher names).
	where := cmp.Or(host, l.p.nc.ConnectedServerName())
	l.stats.w.consumer.Store(&where)
	l.stats.w.quietSince.Store(time.Now())
	if l.p.stopping(host) {
		// Placed on a server that has said it is shutting down: it would vanish without a word.
		return fmt.Errorf("%w: %s", errOnStoppingServer, host)
	}
	r := &reader{l: l, next: next, out: out, failed: make(chan error, 1)}
	r.ctx, r.cancel = context.WithCancel(ctx)
	defer r.cancel()
	// One pull request at a time, sent when everything of the last one has been handed on.
	cc, err := cons.Consume(r.handle,
		jetstream.PullMaxMessagesWithBytesLimit(l.p.cfg.PullBatch, l.p.pullBytes),
		jetstream.PullThresholdMessages(1), jetstream.PullHeartbeat(l.p.cfg.Heartbeat),
		jetstream.ConsumeErrHandler(r.consumeErr))
	if err != nil {
		return err
	}
	var why error
	select {
	case <-ctx.Done():
	case why = <-r.failed:
	case <-l.replace:
		why = errConsumerQuiet
	}
	if errors.Is(why, jetstream.ErrServerShutdown) {
		l.p.stopped(host)
	}
	r.finish()
	cc.Stop()
	return why
}

// deleteConsumer deletes a consumer consume is done with, rather than leave it on the server
// until its inactive threshold. It does not matter when it fails: the server removes it then.
func (l *lane) deleteConsumer(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), consumerCreateTimeout)
	defer cancel()
	_ = l.p.js.DeleteConsumer(ctx, l.stream, name)
}

// reader is one consumer's callback state. The mutex, held through the feed, orders the
// callback against finish: after finish returns, no call hands anything on.
type reader struct {
	l      *lane
	ctx    context.Context // ends with finish: a call waiting for the feed gives up
	cancel context.CancelFunc
	failed chan error // capacity 1: why the consumer failed, the first reason only

	mu   sync.Mutex
	next *uint64 // the sequence to hand on next; read's, written only here until finish
	out  chan<- delivery
	dseq uint64 // the consumer sequence of the last message handed on
	done bool
}

// fail reports why the consumer cannot go on. It never blocks.
func (r *reader) fail(err error) {
	select {
	case r.failed <- err:
	default:
	}
}

// consumeErr receives what the consumer reports: everything ends it but a new leader of the
// consumer, after which nats.go asks again (anything that new leader lost shows as a gap).
func (r *reader) consumeErr(_ jetstream.ConsumeContext, err error) {
	if errors.Is(err, jetstream.ErrConsumerLeadershipChanged) {
		return
	}
	r.fail(err)
}

// finish stops the callback for good; consume calls it before it returns.
func (r *reader) finish() {
	r.cancel()
	r.mu.Lock()
	r.done = true
	r.mu.Unlock()
}

func (r *reader) handle(m jetstream.Msg) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return
	}
	l := r.l
	ack, ok := subjects.ParseAck(m.Reply())
	switch {
	case !ok:
		r.done = true
		r.fail(errors.New("lanes: cannot read the stream sequence from reply subject " + strconv.Quote(m.Reply())))
		return
	case ack.ConsumerSeq != r.dseq+1 || ack.StreamSeq < *r.next:
		r.done = true
		r.fail(fmt.Errorf("%w: delivery %d after %d, stream sequence %d from %d on", errGap, ack.ConsumerSeq, r.dseq, ack.StreamSeq, *r.next))
		return
	case ack.ConsumerSeq == 1:
		// The first message of a consumer. INCOMING may have been deleted and created again
		// since the lane fenced its checkpoint (that ends a consumer): a consumer of the new
		// stream at the old position would skip the new stream's first messages.
		if err := l.checkIncarnation(r.ctx); err != nil {
			r.done = true
			r.fail(err)
			return
		}
	}
	d := delivery{msg: m, seq: ack.StreamSeq, size: int64(len(m.Subject()) + len(m.Reply()) + headerSize(m.Headers()) + len(m.Data()))}
	if !l.feed.wait(r.ctx, d.size, int64(l.p.pullBytes)) {
		return
	}
	select {
	case r.out <- d:
		r.dseq = ack.ConsumerSeq
		*r.next = ack.StreamSeq + 1
		l.stats.pending.Store(ack.Pending)
		l.stats.next.Store(ack.StreamSeq + 1)
		l.stats.w.quietSince.Store(time.Now())
	case <-r.ctx.Done():
		l.feed.taken(d.size) // not handed on after all
	}
}

// checkIncarnation returns [ErrIncomingRecreated] when the lane's stream is no longer the one the
// lane fenced its checkpoint in.
//
// It asks the stream's leader, which a server stopping gracefully has just handed over: a request
// on its way to the old one is never answered, so each attempt waits incarnationAttempt, and a
// timed-out one is made again while ctx lasts, up to incarnationAttempts times.
func (l *lane) checkIncarnation(ctx context.Context) error {
	var inc string
	var err error
	for range incarnationAttempts {
		actx, cancel := context.WithTimeout(ctx, incarnationAttempt)
		inc, _, err = l.p.incoming(actx, l.stream)
		timedOut := actx.Err() != nil && ctx.Err() == nil
		cancel()
		if err == nil || !timedOut {
			break
		}
	}
	if err != nil {
		return err
	}
	if inc != l.inc {
		return fmt.Errorf("%w: partition %d was reading incarnation %s, %s is now %s", ErrIncomingRecreated, l.a.Partition, l.inc, l.stream, inc)
	}
	return nil
}

// incarnationAttempt bounds one read of the stream's incarnation by a new consumer's first
// delivery, and incarnationAttempts how many are made before the consumer is given up.
const (
	incarnationAttempt  = 500 * time.Millisecond
	incarnationAttempts = 10
)

// feedLen is how many consumed messages the reader may hand on before the lane takes them.
const feedLen = 64

// feed bounds the bytes of the messages the reader has handed to the lane and the lane has
// not taken yet (up to feedLen of them wait in a channel): the reader→lane feed, not to be taken
// for a partition's handover between owners (package election) or direct mode's handoff. The
// first message always passes, whatever its size.
type feed struct {
	bytes atomic.Int64
	room  chan struct{} // capacity 1: the lane took a message since the reader last looked
}

// wait waits until a message of size bytes fits under limit, and counts it. It returns false if
// ctx ended first. Only the reader calls it.
func (f *feed) wait(ctx context.Context, size, limit int64) bool {
	for {
		if n := f.bytes.Load(); n == 0 || n+size <= limit {
			f.bytes.Add(size)
			return true
		}
		select {
		case <-f.room:
		case <-ctx.Done():
			return false
		}
	}
}

// taken tells the reader that the lane took a message of size bytes.
func (f *feed) taken(size int64) {
	f.bytes.Add(-size)
	select {
	case f.room <- struct{}{}:
	default:
	}
}

// headerSize is the size of h on the wire, as nats.go counts it.
func headerSize(h nats.Header) int {
	if len(h) == 0 {
		return 0
	}
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + 4 // ": " and CRLF
		}
	}
	return n
}
