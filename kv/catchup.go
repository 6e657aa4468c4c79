package kv

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// loadMark records a completed load: the watch that made it had delivered everything the
// bucket's stream held up to last when it began. created identifies that stream, so that a
// bucket deleted and created again is not taken for the one the table loaded; it is zero when
// the watch could not read the bucket's status.
type loadMark struct {
	created time.Time
	last    uint64
}

// CatchUp blocks until the table has applied everything the bucket held when CatchUp was called,
// so that a caller which then looks devices up sees values at least as new as any other replica
// could have applied before that moment. It reads the last sequence of the bucket's stream (0 when
// the stream holds no message), then waits until a completed load of that same stream (not an
// earlier one the bucket had before it was deleted and created again) has reached it: by applying
// it ([Table.Revision] counts delete and purge markers too), or, when that message is gone without
// a marker (removed, expired), by a watch that began after it was written, which the stall check
// of [Table.Run] starts within about two check intervals. It needs Run to be running.
//
// CatchUp returns nil at once when the table is already there, as it is for an empty bucket once
// [Table.Ready] is closed. While the bucket's status cannot be read it retries with Run's backoff.
// It returns an error wrapping ctx's cause, and naming the revision awaited, when ctx ends first;
// and one wrapping [nats.ErrConnectionClosed] if the connection is closed. It logs at warn level,
// once, if the wait lasts ten check intervals. Safe for concurrent use.
func (t *Table) CatchUp(ctx context.Context) error {
	if t.bucket == nil {
		return nil // an unbound table, filled by tests
	}
	last, created, err := t.lastSeq(ctx)
	if err != nil {
		return err
	}
	if t.reached(last, created) {
		return nil
	}
	start := time.Now()
	t.log.Debug().Uint64("awaited", last).Uint64("revision", t.Revision()).
		Msg("waiting for the groups table to catch up")
	slow := time.NewTimer(10 * t.checkEvery)
	defer slow.Stop()
	for {
		// Take the wake channel before testing, so that an advance between the test and the
		// select closes the channel we wait on.
		wake := t.waitChan()
		if t.reached(last, created) {
			t.log.Debug().Uint64("awaited", last).Int64("waited_ms", time.Since(start).Round(time.Millisecond).Milliseconds()).Msg("groups table caught up")
			return nil
		}
		select {
		case <-wake:
		case <-slow.C:
			t.log.Warn().Uint64("awaited", last).Uint64("revision", t.Revision()).Int64("waited_ms", time.Since(start).Round(time.Millisecond).Milliseconds()).
				Msg("groups table has not caught up with the bucket; the caller keeps waiting")
		case <-ctx.Done():
			return fmt.Errorf("kv: catching up with groups revision %d (table at %d): %w",
				last, t.Revision(), context.Cause(ctx))
		}
	}
}

// lastSeq reads the last sequence and the creation time of the bucket's stream, retrying with
// backoff until it succeeds, ctx ends or the connection is closed.
func (t *Table) lastSeq(ctx context.Context) (uint64, time.Time, error) {
	backoff := t.retryMin
	for {
		sctx, cancel := context.WithTimeout(ctx, max(t.checkEvery, time.Second))
		status, err := t.bucket.Status(sctx)
		cancel()
		if err == nil {
			bs, ok := status.(*jetstream.KeyValueBucketStatus)
			if !ok {
				return 0, time.Time{}, fmt.Errorf("kv: bucket status of type %T has no stream info", status)
			}
			info := bs.StreamInfo()
			if info.State.Msgs == 0 {
				return 0, info.Created, nil // LastSeq stays after the messages are gone
			}
			return info.State.LastSeq, info.Created, nil
		}
		if errors.Is(err, nats.ErrConnectionClosed) {
			return 0, time.Time{}, fmt.Errorf("kv: reading groups bucket status: %w", err)
		}
		if ctx.Err() != nil {
			return 0, time.Time{}, fmt.Errorf("kv: reading groups bucket status: %w", context.Cause(ctx))
		}
		t.log.Warn().Err(err).Str("bucket", t.bucket.Bucket()).Int64("retry_in_ms", backoff.Round(time.Millisecond).Milliseconds()).
			Msg("cannot read groups bucket status to catch up; retrying")
		timer := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			timer.Stop()
			return 0, time.Time{}, fmt.Errorf("kv: reading groups bucket status: %w", context.Cause(ctx))
		case <-timer.C:
		}
		backoff = min(2*backoff, t.retryMax)
	}
}

// reached reports whether a completed load of the stream created at created has applied or
// passed revision last.
func (t *Table) reached(last uint64, created time.Time) bool {
	m := t.loaded.Load()
	if m == nil {
		return false
	}
	if !m.created.IsZero() && !created.IsZero() && !m.created.Equal(created) {
		return false // the table still holds the bucket's previous incarnation
	}
	return t.rev.Load() >= last || m.last >= last
}

// waitChan returns the channel the writer closes at its next advance, creating it if nobody
// waits yet.
func (t *Table) waitChan() <-chan struct{} {
	for {
		if p := t.wake.Load(); p != nil {
			return *p
		}
		ch := make(chan struct{})
		if t.wake.CompareAndSwap(nil, &ch) {
			return ch
		}
	}
}

// advanced wakes the CatchUp calls waiting, if any. Only the writer calls it, after it has
// stored the new revision or load mark; with nobody waiting it costs one atomic load.
func (t *Table) advanced() {
	if p := t.wake.Load(); p != nil && t.wake.CompareAndSwap(p, nil) {
		close(*p)
	}
}

// markLoaded records a completed load of the stream created at created, whose watch began when
// the stream ended at last, and wakes the waiters.
func (t *Table) markLoaded(created time.Time, last uint64) {
	t.loaded.Store(&loadMark{created: created, last: last})
	t.advanced()
}
