package lanes

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
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
		if !isConflict(err) {
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
	e, err := l.p.ctl.Get(ctx, l.key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		rev, err := l.p.ctl.Create(ctx, l.key, []byte("0"))
		if err != nil {
			return 0, err
		}
		l.cpRev = rev
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	seq, err := strconv.ParseUint(string(e.Value()), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: %s holds %q, not a stream sequence; set it with `nats kv put %s %s <sequence>`",
			ErrInvalidConfig, l.key, e.Value(), e.Bucket(), l.key)
	}
	rev, err := l.p.ctl.Update(ctx, l.key, e.Value(), e.Revision())
	if err != nil {
		return 0, err
	}
	l.cpRev = rev
	return seq, nil
}

// checkpoint writes the acknowledged prefix if it moved, with compare-and-set on the revision of
// the lane's own last write. A conflict means a newer owner has fenced the partition (or, after
// a write that timed out but was applied, that the lane cannot tell: it stops either way, which
// is the safe side; its owner restarts it from what is stored).
func (l *lane) checkpoint(ctx context.Context) error {
	if l.acked == l.checkpointed {
		return nil
	}
	// Not cancelled with the lane: a write cut short by cancellation may still be applied, and the
	// lane's next write would then conflict with its own and read as fencing.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var b [20]byte
	val := strconv.AppendUint(b[:0], l.acked, 10)
	rev, err := l.p.ctl.Update(ctx, l.key, val, l.cpRev)
	switch {
	case err == nil:
		l.cpRev, l.checkpointed = rev, l.acked
		l.stats.checkpoint.Store(l.acked)
		l.unsure = l.unsure[:0]
		return nil
	case isConflict(err) && l.adopt(ctx):
		return nil // the next tick writes again, on the adopted revision
	case isConflict(err):
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
	stored, err := strconv.ParseUint(string(e.Value()), 10, 64)
	if err != nil || !slices.Contains(l.unsure, stored) {
		return false
	}
	l.cpRev, l.unsure = e.Revision(), l.unsure[:0]
	return true
}

// isConflict tells a failed compare-and-set. On R1 buckets the server answers with "key exists",
// on replicated ones with "wrong last sequence": both mean someone else wrote.
func isConflict(err error) bool {
	return errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch)
}
