package lanes

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/wire"
)

// recover waits until every in-flight publish has settled, then resends, in stream order, every
// one that was not acknowledged. Messages the server had stored are dropped by OUTGOING as
// duplicates of their Nats-Msg-Id; the others are stored now, in order. A message OUTGOING
// refuses for good (too large, not allowed) is dead-lettered instead.
//
// When a publish went unanswered (a timeout, a stall, a reconnect, no stream listening: the
// stream may have no leader), the first message is resent alone, and the rest only once it is
// stored: a stream that gets its leader back in the middle of a round would store the end of
// the round and lose its start, whose resend would then land behind it.
func (l *lane) recover(ctx context.Context) error {
	if err := l.settle(ctx); err != nil {
		return nil // ctx is done: the caller stops the lane
	}
	l.popSettled()
	var first error
	probe := false
	for _, e := range l.q {
		if e.err == nil {
			continue
		}
		if first == nil {
			first = e.err
		}
		probe = probe || unanswered(e.err)
	}
	if first == nil {
		l.failed = false
		return nil
	}
	l.p.failures.Add(1)
	if l.backoff == 0 {
		l.backoff = l.p.cfg.RetryBackoff
	} else {
		l.backoff = min(2*l.backoff, l.p.cfg.MaxRetryBackoff)
	}
	if probe {
		// A stream electing a leader is asked again often enough to resume soon after.
		l.backoff = min(l.backoff, maxProbeBackoff)
	}
	l.p.warn("publish", func(ev *zerolog.Event) {
		ev.Int("partition", l.a.Partition).Err(first).Int("in_flight", len(l.q)).Dur("retry_in", l.backoff).
			Msg("publish failed; resending in order (on a cluster this is expected for a few seconds while a stream elects its leader; if it persists, check that the OUTGOING and UNMAPPED streams exist and the servers are reachable)")
	})
	t := time.NewTimer(l.backoff)
	select {
	case <-t.C:
	case <-ctx.Done():
		t.Stop()
		return nil
	}
	l.failed = false
	// A resent message may now be stored after a later one of its device that was not
	// refused: look at every message in flight now as it leaves the queue.
	l.ro.until = max(l.ro.until, l.q[len(l.q)-1].seq)
	gen := l.p.generation()
	for _, e := range l.q {
		if e.acked {
			continue
		}
		if !l.clock.publish(e.cost) || errors.Is(context.Cause(ctx), ErrFenced) {
			return ErrFenced
		}
		if l.p.generation() != gen {
			// Reconnected during this pass: what was sent before may be lost, and sending more
			// now could overtake it. The next round starts from the first unacknowledged.
			l.expire(time.Now())
			break
		}
		if reason, why := l.refusal(e); reason != "" {
			if !l.refused(e, reason, why) {
				continue // given up: counted and logged
			}
		}
		l.p.retries.Add(1)
		l.send(e, gen)
		if e.err != nil {
			break // not even sent: the next round starts here
		}
		if probe {
			probe = false
			if !l.probed(ctx, e) {
				return nil // the next round starts from it again, or the lane stops
			}
		}
	}
	return nil
}

// maxProbeBackoff bounds the pause between resend rounds that start with a probe, so that a
// stream that elected a new leader is written again within about this.
const maxProbeBackoff = 500 * time.Millisecond

// unanswered tells a failure that says nothing about the message from one the stream answered:
// a timeout, a stall, a publish that was overtaken, a reconnect, no stream listening. After one,
// the stream may be without a leader.
func unanswered(err error) bool {
	var apiErr *jetstream.APIError
	return !errors.As(err, &apiErr)
}

// probed waits until e, resent alone, is settled, and reports whether it was stored. While it
// waits nothing else is sent.
func (l *lane) probed(ctx context.Context, e *entry) bool {
	for !e.settled() {
		if !l.clock.holds() {
			return false
		}
		if err := l.wait(ctx); err != nil {
			return false
		}
	}
	if !e.acked {
		l.failed = true
	}
	return e.acked
}

// refused handles a publish refused for good. A message for OUTGOING becomes a dead letter; a
// dead letter refused in turn is resent stripped to its reason, error, subject and id headers
// and no payload; if even that is refused, the lane gives up on it — counted as dropped and
// logged as an error — rather than block the partition. It returns false when it gave up.
// Whatever is dropped stays in INCOMING under the sequence the log names.
func (l *lane) refused(e *entry, reason, why string) bool {
	switch {
	case e.reason == "":
		l.p.warn("refused", func(ev *zerolog.Event) {
			ev.Int("partition", l.a.Partition).Uint64("seq", e.seq).Str("reason", reason).Str("error", why).
				Msg("OUTGOING (or PARKED, for a park) refused a message for good; dead-lettered to UNMAPPED")
		})
		l.redirect(e, reason, why)
	case !e.stripped:
		l.p.warn("refused-dead", func(ev *zerolog.Event) {
			ev.Int("partition", l.a.Partition).Uint64("seq", e.seq).Str("error", why).
				Msg("UNMAPPED refused a dead letter; resending it without payload and original headers")
		})
		l.strip(e, why)
	default:
		l.p.dropped.Add(1)
		l.log.Error().Uint64("seq", e.seq).Str("error", why).
			Msg("UNMAPPED refused even a stripped dead letter; giving up on it (it stays in INCOMING at this sequence): check UNMAPPED's limits")
		e.err, e.acked, e.reason = nil, true, wire.ReasonDropped
		return false
	}
	return true
}

// strip reduces a dead letter to what says why it is one: no payload, no original headers.
func (l *lane) strip(e *entry, why string) {
	old := e.msg.Header
	hdr := nats.Header{
		nats.MsgIdHdr:      old[nats.MsgIdHdr],
		wire.HeaderReason:  old[wire.HeaderReason],
		wire.HeaderSubject: []string{e.src.Subject()},
	}
	if v := old.Get(wire.HeaderError); v != "" {
		why = v + "; then: " + why
	}
	hdr[wire.HeaderError] = []string{why}
	e.msg = &nats.Msg{Subject: e.msg.Subject, Header: hdr}
	e.stripped = true
}
