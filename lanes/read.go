package lanes

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

// read consumes the lane's partition from INCOMING in stream order, starting at sequence next,
// and hands each message to out until ctx is done. The ordered consumer recreates itself on
// reconnects, gaps and a deleted consumer; read recreates it from the last sequence it handed on
// when the consumer gives up for any other reason (the stream was deleted, say).
func (l *lane) read(ctx context.Context, next uint64, out chan<- delivery) {
	backoff := l.p.cfg.RetryBackoff
	for ctx.Err() == nil {
		err := l.consume(ctx, &next, out)
		if ctx.Err() != nil {
			return
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
				Msg("consuming INCOMING failed; retrying (check that the INCOMING stream exists: kvmapper setup)")
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

func (l *lane) consume(ctx context.Context, next *uint64, out chan<- delivery) error {
	cons, err := l.p.js.OrderedConsumer(ctx, l.p.cfg.Incoming, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{l.p.cfg.Layout.Filter(l.a.Partition)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    *next,
	})
	if err != nil {
		return err
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(l.p.cfg.PullBatch), jetstream.PullHeartbeat(l.p.cfg.Heartbeat))
	if err != nil {
		return err
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	for {
		m, err := it.Next()
		if err != nil {
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) && ctx.Err() != nil {
				return nil
			}
			return err
		}
		ack, ok := subjects.ParseAck(m.Reply())
		if !ok {
			return errors.New("lanes: cannot read the stream sequence from reply subject " + strconv.Quote(m.Reply()))
		}
		if ack.ConsumerSeq == 1 {
			// The first message of a consumer: this one, or one the ordered consumer created for
			// itself after a reset. A reset follows a deleted consumer, which is what deleting
			// INCOMING does; a consumer recreated on a new INCOMING would go on at the old
			// position, skipping the new stream's first messages.
			if err := l.checkIncarnation(ctx); err != nil {
				return err
			}
		}
		select {
		case out <- delivery{msg: m, seq: ack.StreamSeq}:
			*next = ack.StreamSeq + 1
			l.stats.pending.Store(ack.Pending)
		case <-ctx.Done():
			return nil
		}
	}
}

// checkIncarnation returns [ErrIncomingRecreated] when INCOMING is no longer the stream the lane
// fenced its checkpoint in.
func (l *lane) checkIncarnation(ctx context.Context) error {
	inc, _, err := l.p.incoming(ctx)
	if err != nil {
		return err
	}
	if inc != l.inc {
		return fmt.Errorf("%w: partition %d was reading incarnation %s, INCOMING is now %s", ErrIncomingRecreated, l.a.Partition, l.inc, inc)
	}
	return nil
}
