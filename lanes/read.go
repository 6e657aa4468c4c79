package lanes

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

// read consumes the lane's partition from its stream (INCOMING filtered, or INCOMING-<p>) in
// stream order, starting at sequence next, and hands each message to out until ctx is done. It
// reads through one consumer at a time (see [lane.consume]) and creates a new one from the last
// sequence it handed on whenever that one fails: a gap, missed heartbeats (its server died), a
// deleted consumer, a stream deleted.
func (l *lane) read(ctx context.Context, next uint64, out chan<- delivery) {
	backoff := l.p.cfg.RetryBackoff
	create, timeouts := consumerCreateTimeout, 0
	for ctx.Err() == nil {
		from := next
		err := l.consume(ctx, &next, out, create)
		switch {
		case errors.Is(err, errCreateTimedOut):
			// One lost creation is a dead server's; more in a row, a cluster slow to answer,
			// which is not to be asked ever faster: from the second on, each waits twice as
			// long, up to maxConsumerCreateTimeout.
			if timeouts++; timeouts > 1 {
				create = min(2*create, maxConsumerCreateTimeout)
			}
		case err == nil || next != from:
			create, timeouts = consumerCreateTimeout, 0
		}
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
		if errors.Is(err, errReaderGap) {
			continue // at once: nothing is wrong with the stream
		}
		l.p.warn("consume", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Err(err).Uint64("next", next).
				Str("stream", l.stream).Msg("consuming INCOMING failed; retrying (on a cluster this is expected for a few seconds after a server died; if it persists, check that the stream exists: kvmapper setup)")
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

// errReaderGap reports a consumer that skipped a delivery (lost in a reconnect): the lane reads
// on through a new one from the last sequence it handed on.
var errReaderGap = errors.New("lanes: a delivery of the consumer was lost")

// consumerCreateTimeout bounds the creation of a lane's consumer at first. On a cluster, the
// meta leader takes a crashed server for offline only once its heartbeats have been missing for
// minutes (nats-server 2.15 events.go, orphMax = 5 × 30s), and may place a consumer created
// meanwhile on that server, which never answers: the lane gives up on it after this and creates
// another, under another name, placed again. From the second creation in a row that times out,
// each waits twice as long, up to maxConsumerCreateTimeout, so that a cluster merely slow to
// answer is not asked ever faster. (nats.go's ordered consumer waits 10s per attempt and, by default, retries
// the same name for ever.)
const (
	consumerCreateTimeout    = 2 * time.Second
	maxConsumerCreateTimeout = 10 * time.Second
)

// errCreateTimedOut reports a consumer creation that got no answer in time.
var errCreateTimedOut = errors.New("lanes: no answer to the creation of a consumer")

// resetAttempts is how many times an ordered consumer (a parked device's drain reads through
// one) tries to recreate itself after a reset before its iterator fails. nats.go's default is
// for ever, under one name: on a cluster, a consumer recreated within seconds of a server's
// crash can be placed on that server (see consumerCreateTimeout), and every attempt at that
// name then waits for an answer that never comes. A new ordered consumer has a new name.
const resetAttempts = 1

// consumerInactive is how long the server keeps a lane's consumer that nobody reads, when the
// lane could not delete it (its process died).
const consumerInactive = time.Minute

// consume reads the lane's partition through one ephemeral, unacknowledged, in-memory consumer
// that starts at *next, as nats.go's ordered consumer does, but under a name of its own and with
// a bounded creation: it returns when the consumer fails in any way, and read creates the next
// one. Each delivery's consumer sequence must follow the last one's; a gap (a delivery lost in a
// reconnect) ends the consumer. It deletes its consumer on the way out.
func (l *lane) consume(ctx context.Context, next *uint64, out chan<- delivery, createTimeout time.Duration) error {
	name := "kvmapper_" + strconv.Itoa(l.a.Partition) + "_" + nats.NewInbox()[len(nats.InboxPrefix):]
	cfg := jetstream.ConsumerConfig{
		Name:              name,
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       *next,
		AckPolicy:         jetstream.AckNonePolicy,
		InactiveThreshold: consumerInactive,
		Replicas:          1,
		MemoryStorage:     true,
		// One filter subject: a filtered read walks the stream, and more filters cost more.
		FilterSubject: l.filter,
	}
	cctx, cancel := context.WithTimeout(ctx, createTimeout)
	cons, err := l.p.js.CreateConsumer(cctx, l.stream, cfg)
	timedOut := cctx.Err() != nil && ctx.Err() == nil
	cancel()
	defer func() {
		// Also when the create timed out: it may have been applied after all.
		dctx, cancel := context.WithTimeout(context.Background(), consumerCreateTimeout)
		_ = l.p.js.DeleteConsumer(dctx, l.stream, name)
		cancel()
	}()
	if err != nil && timedOut {
		return fmt.Errorf("%w on %s within %v: %w", errCreateTimedOut, l.stream, createTimeout, err)
	}
	if err != nil {
		return fmt.Errorf("creating a consumer on %s: %w", l.stream, err)
	}
	// One pull request at a time, sent when everything of the last one has been read: the
	// consumer then holds at most one request's worth, PullBatch messages and pullBytes bytes.
	// (With requests bounded in bytes, the server ends each with a status message, which takes
	// a slot of the consumer's buffer, sized for the messages alone: a second request open
	// while the reader waits for the lane would overflow it, and nats.go would drop a message
	// as a slow consumer.)
	it, err := cons.Messages(jetstream.PullMaxMessagesWithBytesLimit(l.p.cfg.PullBatch, l.p.pullBytes),
		jetstream.PullThresholdMessages(1), jetstream.PullHeartbeat(l.p.cfg.Heartbeat),
		jetstream.WithMessagesErrOnMissingHeartbeat(true))
	if err != nil {
		return err
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	var delivered uint64
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
		if ack.ConsumerSeq != delivered+1 {
			return fmt.Errorf("%w: delivery %d after %d", errReaderGap, ack.ConsumerSeq, delivered)
		}
		delivered = ack.ConsumerSeq
		if delivered == 1 {
			// The first message of a consumer. A consumer is created again after a failure,
			// which is what deleting INCOMING causes; one created on a new INCOMING would go on
			// at the old position, skipping the new stream's first messages.
			if err := l.checkIncarnation(ctx); err != nil {
				return err
			}
		}
		d := delivery{msg: m, seq: ack.StreamSeq, size: int64(len(m.Subject()) + len(m.Reply()) + headerSize(m.Headers()) + len(m.Data()))}
		if !l.handoff.wait(ctx, d.size, int64(l.p.pullBytes)) {
			return nil
		}
		select {
		case out <- d:
			*next = ack.StreamSeq + 1
			l.stats.pending.Store(ack.Pending)
		case <-ctx.Done():
			return nil
		}
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
