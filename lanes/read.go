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
		seq, pending, ok := replyInfo(m.Reply())
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

// replyInfo reads the stream sequence and the consumer's pending count from a JetStream reply
// subject without allocating: "$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>",
// or, in the newer form of 12 tokens, with domain and account hash after "$JS.ACK." and a random
// token at the end.
func replyInfo(reply string) (seq, pending uint64, ok bool) {
	if !strings.HasPrefix(reply, "$JS.ACK.") {
		return 0, 0, false
	}
	var seqAt, pendingAt int
	switch n := strings.Count(reply, ".") + 1; {
	case n == 9:
		seqAt, pendingAt = 5, 8
	case n >= 11:
		seqAt, pendingAt = 7, 10
	default:
		return 0, 0, false
	}
	var err1, err2 error
	for i := 0; i <= pendingAt; i++ {
		tok := reply
		if j := strings.IndexByte(reply, '.'); j >= 0 {
			tok, reply = reply[:j], reply[j+1:]
		}
		switch i {
		case seqAt:
			seq, err1 = strconv.ParseUint(tok, 10, 64)
		case pendingAt:
			pending, err2 = strconv.ParseUint(tok, 10, 64)
		}
	}
	return seq, pending, err1 == nil && err2 == nil
}
