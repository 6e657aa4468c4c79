package replay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/wire"
)

// read hands every message of src after src.Done through src.Last to out, in stream order, with
// an ordered consumer of its own (the running replicas' consumers are not touched). It returns nil
// when the range is read, or when ctx ends; the ordered consumer recreates itself after
// reconnects and gaps.
func (r *Replay) read(ctx context.Context, src source, out chan<- jetstream.Msg) error {
	from := src.Done + 1
	if left, err := r.anyLeft(ctx, src, from); err != nil || !left {
		return err
	}
	occ := jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: from}
	if src.Filter != "" {
		occ.FilterSubjects = []string{src.Filter}
	}
	cons, err := r.js.OrderedConsumer(ctx, src.Stream, occ)
	if err != nil {
		return fmt.Errorf("replay: reading stream %s: %w", src.Stream, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(256))
	if err != nil {
		return fmt.Errorf("replay: reading stream %s: %w", src.Stream, err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	next := from
	for {
		m, err := it.Next(jetstream.NextMaxWait(r.cfg.IdleCheck))
		if errors.Is(err, nats.ErrTimeout) {
			// Nothing came: messages still to come may have been removed meanwhile.
			left, err := r.anyLeft(ctx, src, next)
			if err != nil || !left {
				return err
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("replay: reading stream %s: %w", src.Stream, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("replay: reading stream %s: %w", src.Stream, err)
		}
		if md.Sequence.Consumer == 1 {
			// The consumer's first message, or the first after it recreated itself: a consumer
			// recreated on a re-created stream would read the new stream's messages as the old's.
			if err := r.checkIncarnation(ctx, src); err != nil {
				return err
			}
		}
		seq := md.Sequence.Stream
		if seq > src.Last {
			return nil
		}
		select {
		case out <- m:
		case <-ctx.Done():
			return nil
		}
		next = seq + 1
		if seq == src.Last || md.NumPending == 0 {
			return nil
		}
	}
}

// anyLeft reports whether src holds a message from sequence from through src.Last.
func (r *Replay) anyLeft(ctx context.Context, src source, from uint64) (bool, error) {
	if from > src.Last {
		return false, nil
	}
	seq, found, err := r.msgAt(ctx, src.Stream, msgGet{Seq: from, NextFor: cmp.Or(src.Filter, ">")})
	return found && seq <= src.Last, err
}

func (r *Replay) checkIncarnation(ctx context.Context, src source) error {
	s, err := r.js.Stream(ctx, src.Stream)
	if err != nil {
		return fmt.Errorf("replay: reading stream %s: %w", src.Stream, err)
	}
	if inc := wire.Incarnation(s.CachedInfo().Created); inc != src.Incarnation {
		return fmt.Errorf("%w: stream %s is incarnation %s now, the replay began on %s", ErrRecreated, src.Stream, inc, src.Incarnation)
	}
	return nil
}

// idPrefix is the start of the Nats-Msg-Id of every message the replay publishes from src:
// "replay:<id>:<stream>:<incarnation>:", followed by the message's sequence in src.
func (r *Replay) idPrefix(src source) string {
	return wire.ReplayMsgIDPrefix(r.id, src.Stream, src.Incarnation)
}

// scan reads what each target stored after its floor, and notes the messages of this replay
// among them that no source's Done covers: a resumed replay does not send those again, even
// after the target's duplicate window has passed. Until Done has passed them all, the floors
// stay where they were, so that a replay killed again finds them again.
func (r *Replay) scan(ctx context.Context) error {
	r.stored = map[string]map[uint64]bool{}
	r.pinTill = make([]uint64, len(r.rec.Sources))
	found := 0
	for _, t := range r.tg.list() {
		floor := r.rec.Floors[t]
		last := r.maxAck[t]
		if last <= floor {
			continue
		}
		cons, err := r.js.OrderedConsumer(ctx, t, jetstream.OrderedConsumerConfig{
			DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: floor + 1, HeadersOnly: true})
		if err != nil {
			return fmt.Errorf("replay: reading stream %s to resume: %w", t, err)
		}
		err = readTo(ctx, cons, last, r.cfg.IdleCheck, func(m jetstream.Msg) {
			id := m.Headers().Get(nats.MsgIdHdr)
			i := strings.LastIndexByte(id, ':')
			if i < 0 {
				return
			}
			si, ok := r.prefixes[id[:i+1]]
			if !ok {
				return
			}
			seq, err := strconv.ParseUint(id[i+1:], 10, 64)
			src := r.rec.Sources[si]
			if err != nil || seq <= src.Done || seq > src.Last {
				return
			}
			if r.stored[src.Stream] == nil {
				r.stored[src.Stream] = map[uint64]bool{}
			}
			r.stored[src.Stream][seq] = true
			r.pinTill[si] = max(r.pinTill[si], seq)
			found++
		})
		if err != nil {
			return fmt.Errorf("replay: reading stream %s to resume: %w", t, err)
		}
	}
	if found > 0 {
		r.pinned = map[string]uint64{}
		for t, f := range r.rec.Floors {
			r.pinned[t] = f
		}
	}
	r.log.Debug().Int("found", found).Msg("read what the targets hold beyond the recorded progress")
	return nil
}

// readTo calls f for each message cons delivers, through stream sequence last. It returns early
// when the consumer has nothing left to deliver (messages removed meanwhile).
func readTo(ctx context.Context, cons jetstream.Consumer, last uint64, idle time.Duration, f func(jetstream.Msg)) error {
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	for {
		m, err := it.Next(jetstream.NextMaxWait(idle))
		if errors.Is(err, nats.ErrTimeout) {
			ci, err := cons.Info(ctx)
			if err != nil {
				return err
			}
			if ci.NumPending == 0 {
				return nil
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			return err
		}
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		if md.Sequence.Stream > last {
			return nil
		}
		f(m)
		if md.Sequence.Stream == last || md.NumPending == 0 {
			return nil
		}
	}
}
