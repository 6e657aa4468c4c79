package lanes

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
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
		seq, ok := streamSeq(m.Reply())
		if !ok {
			return errors.New("lanes: cannot read the stream sequence from reply subject " + strconv.Quote(m.Reply()))
		}
		select {
		case out <- delivery{msg: m, seq: seq}:
			*next = seq + 1
		case <-ctx.Done():
			return nil
		}
	}
}

// streamSeq reads the stream sequence from a JetStream reply subject without allocating:
// "$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>", or with the domain
// and account hash tokens after "$JS.ACK." in the newer form of 12 tokens or more.
func streamSeq(reply string) (uint64, bool) {
	if !strings.HasPrefix(reply, "$JS.ACK.") {
		return 0, false
	}
	n := strings.Count(reply, ".") + 1
	want := 5
	switch {
	case n == 9:
	case n >= 11:
		want = 7
	default:
		return 0, false
	}
	for i := 0; i < want; i++ {
		reply = reply[strings.IndexByte(reply, '.')+1:]
	}
	if j := strings.IndexByte(reply, '.'); j >= 0 {
		reply = reply[:j]
	}
	seq, err := strconv.ParseUint(reply, 10, 64)
	return seq, err == nil
}
