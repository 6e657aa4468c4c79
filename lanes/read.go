package lanes

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

// read consumes the lane's partition from its stream (INCOMING filtered, or INCOMING-<p>) in
// stream order, starting at sequence next, and hands each message to out until ctx is done. The
// ordered consumer recreates itself on reconnects, gaps, missed heartbeats and a deleted
// consumer, once (see [resetAttempts]); read creates a new one from the last sequence it handed
// on when that fails or the consumer gives up for any other reason (the stream was deleted, say).
func (l *lane) read(ctx context.Context, next uint64, out chan<- delivery) {
	backoff := l.p.cfg.RetryBackoff
	for ctx.Err() == nil {
		from := next
		err := l.consume(ctx, &next, out)
		if ctx.Err() != nil {
			return
		}
		if next != from {
			backoff = l.p.cfg.RetryBackoff // it read again since the last failure
		}
		if errors.Is(err, ErrIncomingRecreated) {
			select {
			case l.readErr <- err: // the lane stops on it
			default: // watchIncarnation reported it first
			}
			return
		}
		l.p.warn("consume", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Err(err).Uint64("next", next).
				Str("stream", l.stream).Msg("consuming INCOMING failed; retrying (check that the stream exists: kvmapper setup)")
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

// resetAttempts is how many times an ordered consumer tries to recreate itself after a reset
// before its iterator fails. nats.go's default is for ever, under one name: on a cluster, a
// consumer recreated within seconds of a server's crash can be placed on that server (the meta
// leader takes a crashed server for offline only once its heartbeats have been missing for
// minutes: nats-server 2.15 events.go, orphMax = 5 × 30s), and every attempt at that name then
// waits for an answer that never comes. A new ordered consumer has a new name, placed again.
const resetAttempts = 1

// consume reads one ordered consumer from *next on and hands its messages to out, until ctx is
// done (it returns nil) or the consumer fails for good: its reset failed, or something it cannot
// recover from (then it returns why, and read starts a new one from *next).
//
// The messages come to a Consume callback on the subscription's own goroutine, which blocks
// while the hand-off is full: the consumer then sends no new pull request (nats.go asks again
// only once the callback has returned for every message of the last one), so it holds at most
// one request's worth, PullBatch messages and pullBytes bytes, as with an iterator. A callback
// costs one allocation per message where the iterator's Next cost five (its options, a heartbeat
// monitor, its timer and closure, the message wrapper: BENCHMARKS-fastbatch.md, section 3).
func (l *lane) consume(ctx context.Context, next *uint64, out chan<- delivery) error {
	occ := jetstream.OrderedConsumerConfig{
		DeliverPolicy:    jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:      *next,
		MaxResetAttempts: resetAttempts,
	}
	if l.filter != "" {
		// One filter subject: a filtered read walks the stream, and more filters cost more.
		occ.FilterSubjects = []string{l.filter}
	}
	cons, err := l.p.js.OrderedConsumer(ctx, l.stream, occ)
	if err != nil {
		return err
	}
	r := &reader{l: l, next: next, out: out, failed: make(chan error, 1)}
	var hctx context.Context
	hctx, r.cancel = context.WithCancel(ctx)
	r.ctx = hctx
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
	}
	r.finish()
	cc.Stop()
	return why
}

// reader is one ordered consumer's callback state. The ordered consumer calls handle on its
// subscription's goroutine, one message at a time; after a reset a new subscription's goroutine
// can call it while the last call of the old one still waits for the hand-off. The mutex,
// held through the hand-off, keeps them in order, and no call hands anything on after finish.
type reader struct {
	l      *lane
	ctx    context.Context // ends with finish: a call waiting for the hand-off gives up
	cancel context.CancelFunc
	failed chan error // capacity 1: why the consumer failed for good, the first reason only

	mu   sync.Mutex
	next *uint64 // the sequence to hand on next; read's, written only here until finish
	out  chan<- delivery
	done bool
}

// fail reports why the consumer cannot go on. It never blocks: nats.go calls consumeErr under
// the ordered consumer's lock.
func (r *reader) fail(err error) {
	select {
	case r.failed <- err:
	default:
	}
}

// consumeErr receives what the consumer reports. The ordered consumer recreates itself after a
// missed heartbeat or a deleted consumer, and a new leader of the consumer only needs a new pull
// request, which nats.go sends; anything else — its reset failed (see [resetAttempts]), "no
// responders" (a reset's request meets it as much as a pull does, and the two cannot be told
// apart), a closed connection, a refused request — ends this consumer.
func (r *reader) consumeErr(_ jetstream.ConsumeContext, err error) {
	switch {
	case errors.Is(err, jetstream.ErrNoHeartbeat), errors.Is(err, jetstream.ErrConsumerDeleted),
		errors.Is(err, jetstream.ErrConsumerLeadershipChanged):
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
	if !ok {
		r.done = true
		r.fail(errors.New("lanes: cannot read the stream sequence from reply subject " + strconv.Quote(m.Reply())))
		return
	}
	if ack.StreamSeq < *r.next {
		return // handed on already, by the subscription a reset replaced
	}
	if ack.ConsumerSeq == 1 {
		// The first message of a consumer: this one, or one the ordered consumer created for
		// itself after a reset. A reset follows a deleted consumer, which is what deleting
		// INCOMING does; a consumer recreated on a new INCOMING would go on at the old
		// position, skipping the new stream's first messages.
		if err := l.checkIncarnation(r.ctx); err != nil {
			r.done = true
			r.fail(err)
			return
		}
	}
	d := delivery{msg: m, seq: ack.StreamSeq, size: int64(len(m.Subject()) + len(m.Reply()) + headerSize(m.Headers()) + len(m.Data()))}
	if !l.handoff.wait(r.ctx, d.size, int64(l.p.pullBytes)) {
		return
	}
	select {
	case r.out <- d:
		*r.next = ack.StreamSeq + 1
		l.stats.pending.Store(ack.Pending)
	case <-r.ctx.Done():
		l.handoff.taken(d.size) // not handed on after all
	}
}

// checkIncarnation returns [ErrIncomingRecreated] when the lane's stream is no longer the one the
// lane fenced its checkpoint in.
func (l *lane) checkIncarnation(ctx context.Context) error {
	inc, _, err := l.p.incoming(ctx, l.stream)
	if err != nil {
		return err
	}
	if inc != l.inc {
		return fmt.Errorf("%w: partition %d was reading incarnation %s, %s is now %s", ErrIncomingRecreated, l.a.Partition, l.inc, l.stream, inc)
	}
	return nil
}

// handoffLen is how many consumed messages the reader may hand on before the lane takes them.
const handoffLen = 64

// handoff bounds the bytes of the messages the reader has handed to the lane and the lane has
// not taken yet (up to handoffLen of them wait in a channel). The first always passes, whatever
// its size.
type handoff struct {
	bytes atomic.Int64
	room  chan struct{} // capacity 1: the lane took a message since the reader last looked
}

// wait waits until a message of size bytes fits under limit, and counts it. It returns false if
// ctx ended first. Only the reader calls it.
func (h *handoff) wait(ctx context.Context, size, limit int64) bool {
	for {
		if n := h.bytes.Load(); n == 0 || n+size <= limit {
			h.bytes.Add(size)
			return true
		}
		select {
		case <-h.room:
		case <-ctx.Done():
			return false
		}
	}
}

// taken tells the reader that the lane took a message of size bytes.
func (h *handoff) taken(size int64) {
	h.bytes.Add(-size)
	select {
	case h.room <- struct{}{}:
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
