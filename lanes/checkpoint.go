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
	"github.com/kvmapper/kvmapper/wire"
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
		rev, err := l.p.ctl.Create(ctx, l.key, wire.Checkpoint{Incarnation: inc}.Append(nil))
		if err != nil {
			return 0, err
		}
		if st.Msgs > 0 {
			// Every partition of a first run with messages waiting says so at once: one line a
			// second, with the number of partitions left out, is enough to tell.
			l.p.warn("no-checkpoint", func(e *zerolog.Event) {
				e.Int("partition", l.a.Partition).Str("stream", l.stream).Uint64("incoming_first", st.FirstSeq).Uint64("incoming_last", st.LastSeq).
					Msg("no checkpoint for this partition: starting from its first message in INCOMING " +
						"(a first run, or the control bucket was re-created: messages older than OUTGOING's " +
						"duplicate window are then republished; kvmapper verify shows them)")
			})
		}
		l.setPosition(inc, rev)
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	cp, err := wire.ParseCheckpoint(e.Value())
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
	l.idPrefix = wire.MsgIDPrefix(l.stream, inc)
}

// cpWrite is one checkpoint write: the prefix it writes, the revision it expects (the lane's
// last write) and the writes of unknown outcome before it, all copied when it starts.
type cpWrite struct {
	seq     uint64
	rev     uint64
	unsure  []uint64
	started time.Time
}

// cpOutcome says how a checkpoint write ended.
type cpOutcome int

const (
	cpWritten  cpOutcome = iota // stored at rev
	cpAdopted                   // a conflict with a write of unknown outcome that was applied: rev is its revision
	cpRestored                  // the key was gone and was created again at rev
	cpFenced                    // written by another owner
	cpFailed                    // no answer, or an error: its outcome is unknown
)

// cpResult is the outcome of a cpWrite.
type cpResult struct {
	w       cpWrite
	outcome cpOutcome
	rev     uint64
	err     error
}

// startCheckpoint starts writing the acknowledged prefix, if it moved and no write is in flight,
// on a goroutine of its own: a write can wait seconds for its answer (a replicated control bucket
// electing a leader), and the lane keeps mapping meanwhile. The lane applies the outcome when it
// arrives on cpDone ([lane.applyCheckpoint]); there is never more than one write in flight, so a
// write never conflicts with the lane's own previous one.
func (l *lane) startCheckpoint() {
	if l.cpBusy || l.acked == l.checkpointed {
		return
	}
	w := cpWrite{seq: l.acked, rev: l.cpRev, unsure: slices.Clone(l.unsure), started: time.Now()}
	l.cpBusy = true
	l.cpWG.Go(func() { l.cpDone <- l.writeCheckpoint(w) })
}

// awaitCheckpoint waits for the write in flight, if any, and applies its outcome.
func (l *lane) awaitCheckpoint() error {
	if !l.cpBusy {
		return nil
	}
	return l.applyCheckpoint(<-l.cpDone)
}

// finalCheckpoint writes the acknowledged prefix, moved or not, and waits for the outcome: the
// last write of a stopping lane. It waits for the write in flight first.
func (l *lane) finalCheckpoint() error {
	err := l.awaitCheckpoint()
	w := cpWrite{seq: l.acked, rev: l.cpRev, unsure: slices.Clone(l.unsure), started: time.Now()}
	if ferr := l.applyCheckpoint(l.writeCheckpoint(w)); err == nil {
		err = ferr
	}
	return err
}

// applyCheckpoint takes the outcome of a write into the lane's state, on the lane's goroutine. A
// write of another owner is [ErrFenced]; a failed write is remembered as of unknown outcome (a
// timeout, a reconnect: it may still have been applied) and retried at the next tick.
func (l *lane) applyCheckpoint(r cpResult) error {
	l.cpBusy = false
	switch r.outcome {
	case cpWritten, cpRestored:
		l.cpRev, l.checkpointed = r.rev, r.w.seq
		l.stats.checkpoint.Store(r.w.seq)
		l.unsure = l.unsure[:0]
		if l.acked > l.checkpointed {
			// Everything acknowledged past the written prefix was acknowledged after the
			// write began: the age of the unwritten part counts from then.
			l.dirtySince = r.w.started
		}
		return nil
	case cpAdopted:
		l.cpRev, l.unsure = r.rev, l.unsure[:0]
		return nil // the next tick writes again, on the adopted revision
	case cpFenced:
		return r.err
	default:
		if len(l.unsure) < maxUnsure {
			l.unsure = append(l.unsure, r.w.seq)
		}
		l.p.warn("checkpoint", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Err(r.err).Msg("writing the checkpoint failed; will retry")
		})
		return nil
	}
}

// writeCheckpoint writes w.seq with compare-and-set on w.rev, the revision of the lane's own last
// write. A conflict means a newer owner has fenced the partition, unless the stored value is one
// of the lane's own writes of unknown outcome (adopt) or the key is gone (restore); otherwise the
// lane stops, which is the safe side (its owner restarts it from what is stored). What conflicted
// is read from the control bucket's leader: a replica behind it could show an older value and
// make the lane stop for nothing. A conflict it cannot read back is a write of unknown outcome,
// tried again at the next tick. It touches no state of the lane: it runs on a goroutine of its
// own.
func (l *lane) writeCheckpoint(w cpWrite) cpResult {
	// Not cancelled with the lane: a write cut short by cancellation may still be applied, and the
	// lane's next write would then conflict with its own and read as fencing.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var b [48]byte
	val := wire.Checkpoint{Incarnation: l.inc, Seq: w.seq}.Append(b[:0])
	rev, err := l.p.ctl.Update(ctx, l.key, val, w.rev)
	switch {
	case err == nil:
		return cpResult{w: w, outcome: cpWritten, rev: rev}
	case !kvcas.IsConflict(err):
		return cpResult{w: w, outcome: cpFailed, err: err}
	}
	m, err := kvcas.Latest(ctx, l.p.js, l.p.ctl.Bucket(), l.key)
	switch {
	case errors.Is(err, kvcas.ErrNotFound) || err == nil && kvcas.Deleted(m):
		if rev, ok := l.restore(ctx, val, w.seq); ok {
			return cpResult{w: w, outcome: cpRestored, rev: rev}
		}
	case err != nil:
		return cpResult{w: w, outcome: cpFailed, err: fmt.Errorf("the checkpoint write conflicted, and reading it back failed: %w", err)}
	case l.adoptable(m, w.unsure):
		return cpResult{w: w, outcome: cpAdopted, rev: m.Sequence}
	}
	return cpResult{w: w, outcome: cpFenced, err: fmt.Errorf("%w: checkpoint of partition %d was written by another owner", ErrFenced, l.a.Partition)}
}

// maxUnsure bounds the checkpoint writes of unknown outcome a lane remembers.
const maxUnsure = 64

// adoptable tells whether the stored checkpoint m, which a write conflicted with, may be the
// lane's own doing: a write whose answer was lost (a timeout, a reconnect) but which the server
// applied. It is if the lease still holds by the lane's own clock and m holds one of those
// writes (unsure); the lane then takes m's revision as its own. A new owner's fence writes back
// the value it read, which could equal one of them too; but a new owner claims only after the
// lease expired on the server, and the lane's clock says invalid before that.
func (l *lane) adoptable(m *jetstream.RawStreamMsg, unsure []uint64) bool {
	if !l.valid() || len(unsure) == 0 {
		return false
	}
	stored, err := wire.ParseCheckpoint(m.Data)
	return err == nil && stored.Incarnation == l.inc && slices.Contains(unsure, stored.Seq)
}

// restore writes the checkpoint again when its key is gone: the control bucket was deleted and
// created again (or someone deleted the key). Without it the partition's next owner would start
// from the first message of INCOMING. The write is a create, so it never overwrites a new
// owner's fence, and it is done even when the lease is lost (the bucket took it along): what it
// writes is a true acknowledged prefix, which the next owner then resumes after. It returns the
// revision written.
func (l *lane) restore(ctx context.Context, val []byte, seq uint64) (uint64, bool) {
	rev, err := l.p.ctl.Create(ctx, l.key, val)
	if err != nil {
		return 0, false
	}
	l.log.Warn().Uint64("checkpoint", seq).
		Msg("the checkpoint key was gone (control bucket re-created, or the key deleted): wrote it again from this lane's position")
	return rev, true
}
