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

	"github.com/kvmapper/kvmapper/ordered"

	"github.com/kvmapper/kvmapper/wire"
)

// entry is one message of the range on its way out. Entries that publish nothing (skipped,
// already stored, a dry run) are settled from the start; they keep their place in the queue
// so that Done advances in stream order.
type entry struct {
	om       ordered.Msg   // what the writer publishes, and what it learnt: Key is seq
	seq      uint64        // the source's sequence
	src      jetstream.Msg // the message read, to rebuild a dead letter from
	msg      *nats.Msg     // what is published; nil when nothing is
	target   string        // the stream that must store msg
	reason   string        // dead-letter reason; "" for a mapped message
	group    string
	stripped bool // a dead letter reduced to its reason after the stream refused it
	dry      bool // a dry run: settled as if stored

	sent  bool   // published at least once to target
	floor uint64 // target's highest acknowledged sequence when first published there
}

func (e *entry) settled() bool { return e.msg == nil || e.dry || e.om.Stored || e.om.Dropped }

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

	answers, err := ordered.NewInbox(r.js.Conn(), 2*r.cfg.MaxInFlight+64)
	if err != nil {
		return fmt.Errorf("replay: %w", err)
	}
	defer answers.Close()
	r.in = answers
	r.w = answers.NewWriter(r.outputs(ctx), ordered.Config{PublishTimeout: r.cfg.PublishTimeout,
		RetryBackoff: r.cfg.RetryBackoff, MaxRetryBackoff: r.cfg.MaxRetryBackoff, CheckStream: true,
		OnFallback: func(stream string, err error) {
			r.log.Warn().Str("stream", stream).Err(err).Msg("the stream refused a batch: replaying into it with single publishes")
		}})
	defer r.w.Close()
	// A resumed replay resends what an earlier run may have stored: counted as the duplicates
	// they are, one at a time until the first new store.
	r.w.Probe()

	tick := time.NewTicker(min(r.cfg.SaveInterval, r.cfg.ReportInterval))
	defer tick.Stop()
	lastSave, lastReport := time.Now(), time.Now()
	var pace *time.Timer
	var next time.Time // when the next message may be read, with MaxRate
	for {
		r.popSettled(src)
		if r.w.Failed() {
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
			if len(in) == 0 || r.cfg.MaxRate > 0 {
				r.w.Flush() // nothing more ready: what was batched goes now
			}
		case <-paceC:
		case a := <-r.in.C():
			r.in.Handle(a)
			r.in.Drain(-1)
		case now := <-tick.C:
			r.w.Expire(now)
			r.w.Flush()
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
	_ = r.w.Settle(wctx)
	r.popSettled(src)
	return why
}

// popSettled takes the settled entries off the head of the queue, in order, advancing src.Done.
// It stops at the first one not stored yet: nothing is counted done before it.
func (r *Replay) popSettled(src *source) {
	for len(r.q) > 0 {
		e := r.q[0]
		if !e.settled() {
			return
		}
		if e.msg != nil && !e.dry {
			r.w.Pop() // e's: the writer's queue holds the published entries, in the same order
		}
		r.q[0] = nil
		r.q = r.q[1:]
		src.Done = e.seq
		r.count(e)
	}
}

// count adds a settled entry to the summary.
func (r *Replay) count(e *entry) {
	if e.msg == nil {
		return // skipped or already stored: counted when taken
	}
	if !e.dry {
		r.maxAck[e.target] = max(r.maxAck[e.target], e.om.Seq, r.w.LastSeq(r.tidx[e.target]))
		if e.om.Duplicate {
			r.sum.Duplicates++
		}
	}
	switch {
	case e.reason == wire.ReasonDropped:
		r.sum.Dropped++
	case e.reason != "":
		r.sum.Reasons[e.reason]++
	default:
		r.sum.Groups[e.group]++
		if !e.om.Duplicate {
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
		e.dry = true // counted as it leaves the queue
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

// send hands e to the writer, for its target.
func (r *Replay) send(e *entry) {
	if !e.sent {
		e.sent, e.floor = true, r.maxAck[e.target]
	}
	e.om.Key, e.om.Stream, e.om.Out = e.seq, r.tidx[e.target], e.msg
	r.w.Send(&e.om)
}

// recover waits until everything in flight has its outcome, then, after a backoff, resends in
// stream order every entry that was not stored (package ordered). The target drops by their
// Nats-Msg-Id the ones it had stored. A message refused for good (too large, not allowed)
// becomes a dead letter; a dead letter refused for good is resent stripped, then given up on
// (logged and counted). A message another stream stored is the end: [ErrTarget].
func (r *Replay) recover(ctx context.Context) error {
	if err := r.w.Settle(ctx); err != nil {
		return nil
	}
	first := r.w.FirstErr()
	if errors.Is(first, ordered.ErrWrongStream) {
		return fmt.Errorf("%w: %w", ErrTarget, first)
	}
	if first != nil {
		pause := r.w.Backoff(first)
		r.warn("publish", func(ev *zerolog.Event) {
			ev.Err(first).Int("in_flight", r.w.Len()).Int64("retry_in_ms", pause.Round(time.Millisecond).Milliseconds()).
				Msg("publish failed; resending in order (if this persists, check that the target streams exist and the server is reachable)")
		})
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil
		}
	}
	return r.w.Resend(ordered.Hooks{Redirect: func(m *ordered.Msg) bool {
		e := r.entryOf(m)
		if e == nil {
			return true
		}
		reason, why := permanent(m.Err)
		if reason == "" {
			return true
		}
		if !r.refused(e, reason, why) {
			return false
		}
		if !e.sent {
			e.sent, e.floor = true, r.maxAck[e.target]
		}
		m.Out, m.Stream = e.msg, r.tidx[e.target]
		return true
	}})
}

// entryOf returns the queue's entry of a message of the writer, or nil.
func (r *Replay) entryOf(m *ordered.Msg) *entry {
	for _, e := range r.q {
		if &e.om == m {
			return e
		}
	}
	return nil
}

// outputs are the writer's streams, the replay's targets, each written as its configuration
// allows (ordered.ModeFor).
func (r *Replay) outputs(ctx context.Context) []ordered.Stream {
	r.tidx = map[string]int{}
	var out []ordered.Stream
	for i, name := range r.tg.list() {
		r.tidx[name] = i
		mode := ordered.ModeSingle
		if s, err := r.js.Stream(ctx, name); err == nil {
			mode = ordered.ModeFor(s.CachedInfo().Config)
		}
		out = append(out, ordered.Stream{Name: name, Mode: mode})
	}
	return out
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
		e.reason = wire.ReasonDropped
		return false // the writer settles it as dropped
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
