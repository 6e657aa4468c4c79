package ordered

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Hooks are the caller's say in a round of resends.
type Hooks struct {
	// Allow, when set, is asked before each message is sent again; false stops the round, and
	// [Writer.Resend] returns [ErrStopped] (the caller's lease ran out, say).
	Allow func(m *Msg) bool
	// Redirect, when set, is called for each message to send again that its stream refused
	// (m.Err is a *jetstream.APIError, or nats.ErrMaxPayload), before it is sent: the caller may
	// change m — another stream, other content — and returns false to give up on it, which then
	// settles as Dropped. Messages that failed for any other reason are sent as they are.
	Redirect func(m *Msg) bool
	// Round, when set, is told of each round of resends before its pause: the first failure,
	// how many messages are not stored, and the pause.
	Round func(first error, unsettled int, pause time.Duration)
}

// Wait waits for one answer, for any writer of the inbox, or for the next look at what expired,
// whichever comes first. It returns ctx's error if ctx ends first.
func (w *Writer) Wait(ctx context.Context) error {
	t := time.NewTimer(min(w.cfg.PublishTimeout/4, 100*time.Millisecond))
	defer t.Stop()
	select {
	case m := <-w.in.c:
		w.in.Handle(m)
	case now := <-t.C:
		w.Expire(now)
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// Settle waits until every message sent has its outcome ([Writer.Settled]), committing what is
// held first. It returns ctx's error if ctx ends first.
func (w *Writer) Settle(ctx context.Context) error {
	w.Flush()
	for {
		w.in.Drain(-1)
		w.Expire(time.Now())
		if w.Settled() {
			return nil
		}
		if err := w.Wait(ctx); err != nil {
			return err
		}
	}
}

// maxProbeBackoff bounds the pause before a round after an unanswered failure, so that a stream
// that elected a new leader is written again within about this.
const maxProbeBackoff = 500 * time.Millisecond

// Backoff returns the pause before the next round of resends, after a failure first: it doubles
// from RetryBackoff to MaxRetryBackoff with each round in a row (a message stored resets it), at
// most 500ms after an unanswered failure.
func (w *Writer) Backoff(first error) time.Duration {
	if w.backoff == 0 {
		w.backoff = w.cfg.RetryBackoff
	} else {
		w.backoff = min(2*w.backoff, w.cfg.MaxRetryBackoff)
	}
	if Unanswered(first) {
		w.backoff = min(w.backoff, maxProbeBackoff)
	}
	return w.backoff
}

// Recover waits until every message sent has its outcome, then, after a pause (see
// [Writer.Backoff]), sends again, in order, every message not stored ([Writer.Resend]). It
// returns nil when ctx ends (the caller stops), and ErrStopped when h.Allow stopped the round.
func (w *Writer) Recover(ctx context.Context, h Hooks) error {
	if w.fenced != nil {
		return w.fenced
	}
	if err := w.Settle(ctx); err != nil {
		return nil
	}
	if w.fenced != nil {
		return w.fenced
	}
	first := w.FirstErr()
	if first != nil {
		pause := w.Backoff(first)
		if h.Round != nil {
			h.Round(first, w.unstored(), pause)
		}
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil
		}
	}
	return w.Resend(h)
}

// unstored counts the messages not stored.
func (w *Writer) unstored() int {
	n := 0
	for _, m := range w.q {
		if !m.Stored && !m.Dropped {
			n++
		}
	}
	return n
}

// Resend sends again, in order, every message not stored, and those given since the failure.
// Call it once [Writer.Settled]; a message still in flight is left alone. After an unanswered
// failure of a single publish, its stream's first message goes alone and the rest once it is
// stored: a stream that gets its leader back in the middle of a round would store the end of the
// round and lose its start. A batch-mode stream whose batch's outcome was lost sends one message
// at a time until one is stored as new (see [Writer.Probe]). A message whose sending fails ends
// the round there: the next starts from it.
func (w *Writer) Resend(h Hooks) error {
	if w.fenced != nil {
		return w.fenced
	}
	w.failed = false
	for _, t := range w.targets {
		t.held, t.pending, t.probing, t.flushed = nil, nil, nil, false
	}
	for _, m := range w.q {
		if m.Err != nil && m.batch == 0 && Unanswered(m.Err) {
			if t := w.targets[m.Stream]; t.Mode == ModeSingle {
				t.probe = true
			}
		}
	}
	for _, m := range w.q {
		if m.Stored || m.Dropped || m.inFlight() {
			continue
		}
		if h.Allow != nil && !h.Allow(m) {
			w.failed = true // the caller stops: not a failure of the stream
			return ErrStopped
		}
		if refused(m.Err) && h.Redirect != nil && !h.Redirect(m) {
			m.Dropped, m.Err = true, nil
			continue
		}
		m.Err, m.sent = nil, false
		w.dispatch(w.targets[m.Stream], m)
		if w.failed {
			break
		}
	}
	w.Flush()
	return nil
}

// refused tells whether err is a stream's (or the connection's) refusal of the message itself.
func refused(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) || errors.Is(err, nats.ErrMaxPayload)
}
