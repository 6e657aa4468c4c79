package replay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/wire"
)

// entry is one message of the range on its way out. Entries that publish nothing (skipped,
// already stored, a dry run) are settled from the start; they keep their place in the queue
// so that Done advances in stream order.
type entry struct {
	seq      uint64
	src      jetstream.Msg // the message read, to rebuild a dead letter from
	msg      *nats.Msg     // what is published; nil when nothing is
	target   string        // the stream that must store msg
	reason   string        // dead-letter reason; "" for a mapped message
	group    string
	stripped bool // a dead letter reduced to its reason after the stream refused it

	fut   jetstream.PubAckFuture
	sent  bool   // published at least once to target
	floor uint64 // target's highest acknowledged sequence when first published there
	ack   *jetstream.PubAck
	err   error
}

func (e *entry) settled() bool { return e.msg == nil || e.ack != nil || e.err != nil }

// poll takes e's outcome if it has come, without waiting.
func (e *entry) poll() {
	if e.settled() || e.fut == nil {
		return
	}
	select {
	case a := <-e.fut.Ok():
		e.ack = a
	case err := <-e.fut.Err():
		e.err = err
	default:
	}
}

// replaySource replays one source from its Done to its Last, or until ctx is done.
func (r *Replay) replaySource(ctx context.Context, i int) error {
	src := &r.rec.Sources[i]
	if src.Done >= src.Last {
		return nil
	}
	readCtx, stopReading := context.WithCancel(ctx)
	in := make(chan jetstream.Msg, 256)
	readErr := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Go(func() {
		// The error is sent before in is closed, so a closed in with nothing in readErr is a
		// range read to its end.
		if err := r.read(readCtx, *src, in); err != nil {
			readErr <- err
		}
		close(in)
	})
	defer func() {
		stopReading()
		wg.Wait()
	}()

	tick := time.NewTicker(min(r.cfg.SaveInterval, r.cfg.ReportInterval))
	defer tick.Stop()
	lastSave, lastReport := time.Now(), time.Now()
	var pace *time.Timer
	var next time.Time // when the next message may be read, with MaxRate
	for {
		r.popSettled(src)
		if r.failed {
			if err := r.recover(ctx); err != nil {
				return r.stop(ctx, src, err)
			}
			if ctx.Err() != nil {
				return r.stop(ctx, src, nil)
			}
			continue
		}
		if in == nil && len(r.q) == 0 {
			break
		}
		var inC <-chan jetstream.Msg
		var paceC <-chan time.Time
		if in != nil && len(r.q) < r.cfg.MaxInFlight {
			if wait := time.Until(next); r.cfg.MaxRate > 0 && wait > 0 {
				if pace == nil {
					pace = time.NewTimer(wait)
				} else {
					pace.Reset(wait)
				}
				paceC = pace.C
			} else {
				inC = in
			}
		}
		var okC <-chan *jetstream.PubAck
		var errC <-chan error
		if len(r.q) > 0 && !r.q[0].settled() && r.q[0].fut != nil {
			okC, errC = r.q[0].fut.Ok(), r.q[0].fut.Err()
		}
		select {
		case m, ok := <-inC:
			if !ok {
				in = nil
				select {
				case err := <-readErr:
					return r.stop(ctx, src, err)
				default:
				}
				continue
			}
			if r.cfg.MaxRate > 0 {
				// A stall (a slow target, the start) earns a burst of at most 50ms' worth: enough
				// to smooth over the timer's granularity.
				if floor := time.Now().Add(-50 * time.Millisecond); next.Before(floor) {
					next = floor
				}
				next = next.Add(time.Duration(float64(time.Second) / r.cfg.MaxRate))
			}
			r.take(src, m)
		case <-paceC:
		case a := <-okC:
			r.q[0].ack = a
		case err := <-errC:
			r.q[0].err = err
		case now := <-tick.C:
			if now.Sub(lastSave) >= r.cfg.SaveInterval && !r.cfg.DryRun {
				lastSave = now
				if err := r.save(ctx); err != nil {
					return r.stop(ctx, src, err)
				}
			}
			if now.Sub(lastReport) >= r.cfg.ReportInterval {
				lastReport = now
				r.report(false)
			}
		case <-ctx.Done():
			return r.stop(ctx, src, nil)
		}
	}
	src.Done = src.Last
	if r.cfg.DryRun {
		return nil
	}
	return r.save(ctx)
}

// stop ends a source early: it stops reading, waits (up to PublishTimeout) for what is in flight
// and takes what was acknowledged into Done. It returns why.
func (r *Replay) stop(ctx context.Context, src *source, why error) error {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout+time.Second)
	defer cancel()
	r.settle(wctx)
	r.popSettled(src)
	return why
}

// settle waits until every entry in the queue has its outcome, or ctx is done.
func (r *Replay) settle(ctx context.Context) {
	for _, e := range r.q {
		if e.settled() || e.fut == nil {
			continue
		}
		select {
		case a := <-e.fut.Ok():
			e.ack = a
		case err := <-e.fut.Err():
			e.err = err
		case <-ctx.Done():
			return
		}
	}
}

// popSettled takes the settled entries off the head of the queue, in order, advancing src.Done.
// It stops at the first failed one and marks the replay failed: nothing new is sent until it is
// resent.
func (r *Replay) popSettled(src *source) {
	for len(r.q) > 0 {
		e := r.q[0]
		e.poll()
		if !e.settled() {
			return
		}
		if e.err == nil && e.ack != nil && e.ack.Stream != e.target {
			e.err = fmt.Errorf("%w: stream %s stored a message meant for %s (%s)", ErrTarget, e.ack.Stream, e.target, e.msg.Subject)
		}
		if e.err != nil {
			r.failed = true
			return
		}
		r.q[0] = nil
		r.q = r.q[1:]
		src.Done = e.seq
		r.count(e)
	}
}

// count adds a settled entry to the summary.
func (r *Replay) count(e *entry) {
	if e.ack != nil {
		r.maxAck[e.target] = max(r.maxAck[e.target], e.ack.Sequence)
		if e.ack.Duplicate {
			r.sum.Duplicates++
		}
	}
	if e.msg == nil {
		return // skipped or already stored: counted when taken
	}
	switch {
	case e.reason == wire.ReasonDropped:
		r.sum.Dropped++
	case e.reason != "":
		r.sum.Reasons[e.reason]++
	default:
		r.sum.Groups[e.group]++
		if e.ack == nil || !e.ack.Duplicate {
			r.sum.Mapped++
		}
	}
}

// take turns one message read into an entry, publishes it unless there is nothing to publish,
// and queues it.
func (r *Replay) take(src *source, m jetstream.Msg) {
	md, err := m.Metadata()
	if err != nil {
		return // not a stream message; the reader only hands on stream messages
	}
	r.sum.Read++
	e := &entry{seq: md.Sequence.Stream, src: m}
	switch {
	case !r.build(e, *src):
		r.sum.Skipped++
		e.msg = nil
	case r.stored[src.Stream][e.seq]:
		r.sum.AlreadyStored++
		e.msg = nil
	case r.cfg.DryRun:
		e.ack = &jetstream.PubAck{Stream: e.target} // counted as it leaves the queue
	case r.fits(e):
		r.send(e)
	}
	r.q = append(r.q, e)
}

// fits checks e against its target's largest message, as the server would, and dead-letters it
// (then strips, then gives up on it) before it is sent: refused by the server, it would be resent
// as a dead letter after the messages sent behind it, and in the same stream that reorders its
// device. It returns false when the replay gave up on it.
func (r *Replay) fits(e *entry) bool {
	for {
		limit, size := r.maxSize[e.target], len(e.msg.Data)+headerSize(e.msg.Header)
		if limit <= 0 || size <= limit {
			return true
		}
		why := fmt.Sprintf("message size %d exceeds the maximum %d of stream %s", size, limit, e.target)
		if !r.refused(e, wire.ReasonOversized, why) {
			return false
		}
	}
}

// headerSize is the size of h on the wire, which the server counts against a stream's largest
// message.
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

// send publishes e to its target.
func (r *Replay) send(e *entry) {
	if !e.sent {
		e.sent, e.floor = true, r.maxAck[e.target]
	}
	e.ack, e.err = nil, nil
	fut, err := r.pub.PublishMsgAsync(e.msg, jetstream.WithRetryAttempts(0))
	if err != nil {
		e.fut, e.err = nil, err
		r.failed = true
		return
	}
	e.fut = fut
}

// recover waits until everything in flight has its outcome, then, after a backoff, resends in
// stream order every entry that was not acknowledged. The target drops by their Nats-Msg-Id the
// ones it had stored. A message refused for good (too large, not allowed) becomes a dead letter; a
// dead letter refused for good is resent stripped, then given up on (logged and counted).
func (r *Replay) recover(ctx context.Context) error {
	r.settle(ctx)
	if ctx.Err() != nil {
		return nil
	}
	var first error
	for _, e := range r.q {
		if e.err != nil {
			first = e.err
			break
		}
	}
	if first == nil {
		r.failed = false
		return nil
	}
	if errors.Is(first, ErrTarget) {
		return first
	}
	r.backoff = min(max(2*r.backoff, r.cfg.RetryBackoff), r.cfg.MaxRetryBackoff)
	r.warn("publish", func(ev *zerolog.Event) {
		ev.Err(first).Int("in_flight", len(r.q)).Dur("retry_in", r.backoff).
			Msg("publish failed; resending in order (if this persists, check that the target streams exist and the server is reachable)")
	})
	t := time.NewTimer(r.backoff)
	select {
	case <-t.C:
	case <-ctx.Done():
		t.Stop()
		return nil
	}
	r.failed = false
	for _, e := range r.q {
		if e.err == nil {
			continue
		}
		if reason, why := permanent(e.err); reason != "" && !r.refused(e, reason, why) {
			continue
		}
		r.send(e)
		if r.failed {
			return nil // not even sent: the next round starts here
		}
	}
	r.backoff = 0
	return nil
}

// refused handles a publish refused for good; it returns false when the replay gave up on the
// message.
func (r *Replay) refused(e *entry, reason, why string) bool {
	switch {
	case e.reason == "":
		r.warn("refused", func(ev *zerolog.Event) {
			ev.Uint64("seq", e.seq).Str("reason", reason).Str("error", why).Str("stream", e.target).
				Msg("the target refused a message for good; dead-lettered")
		})
		r.redirect(e, reason, why)
	case !e.stripped:
		r.warn("refused-dead", func(ev *zerolog.Event) {
			ev.Uint64("seq", e.seq).Str("error", why).Str("stream", e.target).
				Msg("the dead-letter stream refused a dead letter; resending it without payload and original headers")
		})
		r.strip(e, why)
	default:
		r.log.Error().Uint64("seq", e.seq).Str("error", why).Str("stream", e.target).
			Msg("the dead-letter stream refused even a stripped dead letter; giving up on it (it stays in INCOMING at this sequence)")
		e.err, e.reason, e.ack = nil, wire.ReasonDropped, &jetstream.PubAck{Stream: e.target}
		return false
	}
	return true
}

// permanent tells whether a publish error is about the message itself, which resending cannot
// fix, and which dead-letter reason it gets (as the live mapper does).
func permanent(err error) (reason, why string) {
	if errors.Is(err, nats.ErrMaxPayload) {
		return wire.ReasonOversized, err.Error()
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch {
		case apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum || apiErr.ErrorCode == errCodeHeaderExceedsMaximum:
			return wire.ReasonOversized, apiErr.Description
		case apiErr.Code == 400:
			return wire.ReasonRejected, apiErr.Description
		}
	}
	return "", ""
}

// errCodeHeaderExceedsMaximum is nats-server's JSStreamHeaderExceedsMaximumErr.
const errCodeHeaderExceedsMaximum jetstream.ErrorCode = 10097
