package lanes

import (
	"context"
	"errors"
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
		seq, pending, ok := subjects.ParseAckReply(m.Reply())
		if !ok {
			return errors.New("lanes: cannot read the stream sequence from reply subject " + strconv.Quote(m.Reply()))
		}
		select {
		case out <- delivery{msg: m, seq: seq}:
			*next = seq + 1
			l.stats.pending.Store(pending)
		case <-ctx.Done():
			return nil
		}
	}
}
