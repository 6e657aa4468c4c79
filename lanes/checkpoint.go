package lanes

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/kvcas"
)

// fence reads the partition's checkpoint and writes it back with compare-and-set before the
// lane consumes anything. A deposed owner's next checkpoint write then fails on the revision,
// which stops it (I3). It returns the checkpointed sequence.
func (l *lane) fence(ctx context.Context) (uint64, error) {
	backoff := l.p.cfg.RetryBackoff
	for {
		seq, err := l.tryFence(ctx)
		if err == nil || errors.Is(err, ErrInvalidConfig) {
			return seq, err
		}
		if !kvcas.IsConflict(err) {
			l.p.warn("fence", func(e *zerolog.Event) {
				e.Int("partition", l.a.Partition).Err(err).Msg("reading the checkpoint failed; retrying")
			})
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, fmt.Errorf("lanes: fencing partition %d: %w", l.a.Partition, err)
		}
		backoff = min(2*backoff, l.p.cfg.MaxRetryBackoff)
	}
}

func (l *lane) tryFence(ctx context.Context) (uint64, error) {
	inc, st, err := l.p.incoming(ctx, l.stream)
	if err != nil {
		return 0, err
	}
	e, err := l.p.ctl.Get(ctx, l.key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		rev, err := l.p.ctl.Create(ctx, l.key, Checkpoint{Incarnation: inc}.Append(nil))
		if err != nil {
			return 0, err
		}
		if st.Msgs > 0 {
			l.log.Warn().Str("stream", l.stream).Uint64("incoming_first", st.FirstSeq).Uint64("incoming_last", st.LastSeq).
				Msg("no checkpoint for this partition: starting from its first message in INCOMING " +
					"(a first run, or the control bucket was re-created: messages older than OUTGOING's " +
					"duplicate window are then republished; kvmapper verify shows them)")
		}
		l.setPosition(inc, rev)
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	cp, err := ParseCheckpoint(e.Value())
	if err != nil {
		return 0, fmt.Errorf("%w: %s holds %q, not <incarnation>:<sequence>; set it with `nats kv put %s %s %s:<sequence>`",
			ErrInvalidConfig, l.key, e.Value(), e.Bucket(), l.key, inc)
	}
	switch cp.Incarnation {
	case inc:
	case "":
		// Written before checkpoints named their stream: taken as this stream's, as it was
		// when it was written.
		l.log.Debug().Uint64("checkpoint", cp.Seq).Msg("checkpoint without incarnation taken as the current INCOMING's")
	default:
		l.log.Warn().Str("stream", l.stream).Str("checkpoint", cp.String()).Str("incarnation", inc).Uint64("incoming_first", st.FirstSeq).
			Msg("the checkpoint belongs to an earlier INCOMING stream (it was deleted and created again): " +
				"starting this partition from the first message of the new stream")
		cp.Seq = 0
	}
	cp.Incarnation = inc
	rev, err := l.p.ctl.Update(ctx, l.key, cp.Append(nil), e.Revision())
	if err != nil {
		return 0, err
	}
	l.setPosition(inc, rev)
	return cp.Seq, nil
}

// setPosition records the incarnation of the stream the lane reads and the revision of its fence.
func (l *lane) setPosition(inc string, rev uint64) {
	l.inc, l.cpRev = inc, rev
	l.idPrefix = MsgIDPrefix(l.stream, inc)
}

// checkpoint writes the acknowledged prefix if it moved, with compare-and-set on the revision of
// the lane's own last write. A conflict means a newer owner has fenced the partition (or, after
// a write that timed out but was applied, that the lane cannot tell: it stops either way, which
// is the safe side; its owner restarts it from what is stored).
func (l *lane) checkpoint(ctx context.Context) error {
	if l.acked == l.checkpointed {
		return nil
	}
	return l.writeCheckpoint(ctx)
}

// writeCheckpoint writes the acknowledged prefix, moved or not; see [lane.checkpoint].
func (l *lane) writeCheckpoint(ctx context.Context) error {
	// Not cancelled with the lane: a write cut short by cancellation may still be applied, and the
	// lane's next write would then conflict with its own and read as fencing.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var b [48]byte
	val := Checkpoint{Incarnation: l.inc, Seq: l.acked}.Append(b[:0])
	rev, err := l.p.ctl.Update(ctx, l.key, val, l.cpRev)
	switch {
	case err == nil:
		l.cpRev, l.checkpointed = rev, l.acked
		l.stats.checkpoint.Store(l.acked)
		l.unsure = l.unsure[:0]
		return nil
	case kvcas.IsConflict(err) && l.adopt(ctx):
		return nil // the next tick writes again, on the adopted revision
	case kvcas.IsConflict(err) && l.restore(ctx, val):
		l.checkpointed = l.acked
		l.stats.checkpoint.Store(l.acked)
		l.unsure = l.unsure[:0]
		return nil
	case kvcas.IsConflict(err):
		return fmt.Errorf("%w: checkpoint of partition %d was written by another owner", ErrFenced, l.a.Partition)
	default:
		// The write may still have been applied (a timeout, a reconnect): remember what it said.
		if len(l.unsure) < maxUnsure {
			l.unsure = append(l.unsure, l.acked)
		}
		l.p.warn("checkpoint", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Err(err).Msg("writing the checkpoint failed; will retry")
		})
		return nil
	}
}

// maxUnsure bounds the checkpoint writes of unknown outcome a lane remembers.
const maxUnsure = 64

// adopt handles a checkpoint conflict that may be the lane's own doing: a write whose answer was
// lost (a timeout, a reconnect) but which the server applied. If the lease still holds by the
// lane's own clock and the stored value is one of those writes, the lane takes the stored
// revision as its own and reports true. A new owner's fence writes back the value it read, which
// could equal one of them too; but a new owner claims only after the lease expired on the
// server, and the lane's clock says invalid before that.
func (l *lane) adopt(ctx context.Context) bool {
	if !l.valid() || len(l.unsure) == 0 {
		return false
	}
	e, err := l.p.ctl.Get(ctx, l.key)
	if err != nil {
		return false
	}
	stored, err := ParseCheckpoint(e.Value())
	if err != nil || stored.Incarnation != l.inc || !slices.Contains(l.unsure, stored.Seq) {
		return false
	}
	l.cpRev, l.unsure = e.Revision(), l.unsure[:0]
	return true
}

// restore writes the checkpoint again when its key is gone: the control bucket was deleted and
// created again (or someone deleted the key). Without it the partition's next owner would start
// from the first message of INCOMING. The write is a create, so it never overwrites a new
// owner's fence, and it is done even when the lease is lost (the bucket took it along): what it
// writes is a true acknowledged prefix, which the next owner then resumes after.
func (l *lane) restore(ctx context.Context, val []byte) bool {
	if _, err := l.p.ctl.Get(ctx, l.key); !errors.Is(err, jetstream.ErrKeyNotFound) {
		return false
	}
	rev, err := l.p.ctl.Create(ctx, l.key, val)
	if err != nil {
		return false
	}
	l.log.Warn().Uint64("checkpoint", l.acked).
		Msg("the checkpoint key was gone (control bucket re-created, or the key deleted): wrote it again from this lane's position")
	l.cpRev = rev
	return true
}
