package lanes

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

// readParked is a drain's reader: it reads where device stands (when start is set), then the
// device's parked messages from PARKED sequence from, handing each to the lane when it wants
// one, until ctx ends. It touches no state of the lane.
func (l *lane) readParked(ctx context.Context, id, gen uint64, device string, from uint64, start bool, want <-chan struct{}) {
	s := l.park
	subj := subjects.ParkedSubject(s.cfg.Prefix, l.a.Partition, device)
	backoff := l.p.cfg.RetryBackoff
	wait := func() bool {
		t := time.NewTimer(backoff)
		defer t.Stop()
		backoff = min(2*backoff, l.p.cfg.MaxRetryBackoff)
		select {
		case <-t.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
	for start {
		l0, err := l.drainPosition(ctx, subj)
		if err == nil {
			if !s.send(ctx, parkEvent{kind: evDrainStart, drain: id, reader: gen, l0: l0}) {
				return
			}
			break
		}
		if ctx.Err() != nil {
			return
		}
		l.p.warn("park-read", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Str("device", device).Err(err).Msg("reading a parked device failed; retrying")
		})
		if !wait() {
			return
		}
	}
	for ctx.Err() == nil {
		before := from
		err := l.consumeParked(ctx, id, gen, subj, &from, want)
		if ctx.Err() != nil {
			return
		}
		if from != before {
			backoff = l.p.cfg.RetryBackoff
		}
		l.p.warn("park-read", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Str("device", device).Err(err).Msg("reading a parked device failed; retrying")
		})
		if !wait() {
			return
		}
	}
}

// drainPosition reads the device's last PARKED sequence (0 when PARKED holds nothing of it),
// from the stream's leader.
func (l *lane) drainPosition(ctx context.Context, subj string) (uint64, error) {
	s := l.park
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ps := s.parked
	if ps == nil {
		var err error
		if ps, err = l.p.js.Stream(ctx, s.cfg.Stream); err != nil {
			return 0, err
		}
	}
	m, err := ps.GetLastMsgForSubject(ctx, subj)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, nil
	case err != nil:
		return 0, err
	}
	return m.Sequence, nil
}

// consumeParked reads subj from *from with an ordered consumer and hands each message on.
func (l *lane) consumeParked(ctx context.Context, id, gen uint64, subj string, from *uint64, want <-chan struct{}) error {
	s := l.park
	occ := jetstream.OrderedConsumerConfig{
		FilterSubjects:    []string{subj},
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		InactiveThreshold: 30 * time.Second,
		MaxResetAttempts:  resetAttempts,
	}
	if *from > 1 {
		occ.DeliverPolicy, occ.OptStartSeq = jetstream.DeliverByStartSequencePolicy, *from
	}
	cons, err := l.p.js.OrderedConsumer(ctx, s.cfg.Stream, occ)
	if err != nil {
		return err
	}
	it, err := cons.Messages(jetstream.PullMaxMessagesWithBytesLimit(drainPull, l.p.pullBytes),
		jetstream.PullThresholdMessages(1), jetstream.PullHeartbeat(l.p.cfg.Heartbeat))
	if err != nil {
		return err
	}
	defer func() {
		it.Stop()
		// An ordered consumer is not deleted when it stops; InactiveThreshold is the fallback.
		if ci := cons.CachedInfo(); ci != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			_ = l.p.js.DeleteConsumer(dctx, s.cfg.Stream, ci.Name)
			cancel()
		}
	}()
	defer context.AfterFunc(ctx, it.Stop)()
	for {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		select {
		case <-want:
		case <-ctx.Done():
			return nil
		}
		if !s.send(ctx, parkEvent{kind: evDrainMsg, drain: id, reader: gen, msg: m, seq: md.Sequence.Stream, at: md.Timestamp}) {
			return nil
		}
		*from = md.Sequence.Stream + 1
	}
}
