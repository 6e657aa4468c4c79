package kv

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// errWatchStopped means the watcher's updates channel closed while Run's context was alive:
// nats.go gave up on its ordered consumer, e.g. because the bucket's stream was deleted.
var errWatchStopped = errors.New("kv: watcher stopped")

// errWatchStalled means a value written since the previous check has not arrived and the watcher
// delivered nothing for a whole check interval. After a server restart the watcher's ordered
// consumer otherwise takes about 20 s to notice that its consumer is gone.
var errWatchStalled = errors.New("kv: watcher stalled")

// errBucketRecreated ends a watch whose bucket was deleted and created again between two checks:
// nats.go's ordered consumer would resume the new stream at the old stream's last sequence and
// skip every revision below it.
var errBucketRecreated = errors.New("kv: bucket was deleted and created again")

// stuckAfterCancel bounds the wait for nats.go to close a cancelled watcher's channel. WatchAll
// has a narrow race (its context can end before it sets the subscription's closed handler) in
// which it never does; the watch then gives up on the channel rather than hang shutdown.
const stuckAfterCancel = 5 * time.Second

// Run watches the bucket until ctx is done (returns nil) or the watch fails for good (returns a
// wrapped error: the connection is closed). It returns only after the goroutines it started have
// exited. If the watch stops or cannot start (server restart, bucket deleted, JetStream
// unavailable), Run keeps serving the table it has and re-watches with backoff; a re-watch
// reloads every key, then removes the devices it did not see. Run may be called only once at a
// time; a concurrent call returns [ErrRunning].
func (t *Table) Run(ctx context.Context) error {
	if !t.running.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer t.running.Store(false)

	backoff := t.retryMin
	for {
		caughtUp, err := t.watch(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if caughtUp {
			backoff = t.retryMin
		}
		switch {
		case errors.Is(err, nats.ErrConnectionClosed):
			return fmt.Errorf("kv: watch bucket %q: %w", t.bucket.Bucket(), err)
		case isNotFound(err):
			t.log.Error().Err(err).Str("bucket", t.bucket.Bucket()).Int("devices", t.Len()).
				Str("fix", "create the bucket: nats kv add "+t.bucket.Bucket()+" (or kvmapper setup)").
				Int64("retry_in_ms", backoff.Round(time.Millisecond).Milliseconds()).Msg("groups bucket not found; serving the last table")
		case errors.Is(err, errWatchStopped), errors.Is(err, errWatchStalled), errors.Is(err, errBucketRecreated):
			t.log.Warn().Err(err).Str("bucket", t.bucket.Bucket()).Int64("retry_in_ms", backoff.Round(time.Millisecond).Milliseconds()).
				Msg("groups watcher lost; re-watching")
		default:
			t.log.Warn().Err(err).Str("bucket", t.bucket.Bucket()).Int64("retry_in_ms", backoff.Round(time.Millisecond).Milliseconds()).
				Msg("cannot watch groups bucket; retrying")
		}
		timer := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-timer.C:
		}
		backoff = min(2*backoff, t.retryMax)
	}
}

func isNotFound(err error) bool {
	return errors.Is(err, jetstream.ErrBucketNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) ||
		errors.Is(err, nats.ErrStreamNotFound)
}

// watch runs one watcher until its updates channel closes. It reports whether the watch caught
// up with the bucket. The error is nil when ctx ended the watch.
func (t *Table) watch(ctx context.Context) (caughtUp bool, err error) {
	// The watcher's subscription lives until wctx is cancelled; nats.go also parks a goroutine
	// on it, so it is cancelled whenever this watch ends.
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// Where the bucket's stream ends now: the initial load is done once the watcher reaches it,
	// even if writes keep coming (then the server never reports nothing pending).
	var startLast uint64
	var created time.Time
	sctx, scancel := context.WithTimeout(ctx, max(t.checkEvery, time.Second))
	if status, err := t.bucket.Status(sctx); err == nil {
		if t.gen == 0 && status.Values() > 0 {
			// The bucket's message count (history and markers included) bounds the device count.
			t.presize(status.Values())
		}
		if bs, ok := status.(*jetstream.KeyValueBucketStatus); ok {
			startLast, created = bs.StreamInfo().State.LastSeq, bs.StreamInfo().Created
		}
	}
	scancel()
	w, err := t.bucket.WatchAll(wctx)
	if err != nil {
		return false, err
	}
	t.watchRev.Store(0)
	var wg sync.WaitGroup
	wg.Go(func() { t.check(wctx, cancel, created) })
	defer func() {
		cancel(nil)
		wg.Wait()
	}()
	t.gen++
	// A re-watch sweeps the devices it did not see, whether or not the earlier watch had
	// finished loading: whatever that watch wrote may be gone from the bucket.
	resync := t.gen > 1
	marker := false
	var pending, seen uint64
	// Draining until the channel closes is also the shutdown path: cancelling wctx unsubscribes,
	// and nats.go closes the channel only after its delivery callback, which blocks on a full
	// channel, has returned. Stopping the drain early would leave that goroutine stuck — unless
	// nats.go never closes it (stuckAfterCancel).
	updates, done := w.Updates(), wctx.Done()
	var stuck <-chan time.Time
loop:
	for {
		var e jetstream.KeyValueEntry
		select {
		case u, ok := <-updates:
			if !ok {
				break loop
			}
			e = u
		case <-done:
			done, stuck = nil, time.After(stuckAfterCancel)
			continue
		case <-stuck:
			t.log.Warn().Msg("groups watcher did not close after cancel; leaving it")
			break loop
		}
		if e == nil {
			marker = true
		} else {
			t.apply(e, !caughtUp)
			t.watchRev.Store(e.Revision())
			pending, seen = e.Delta(), max(seen, e.Revision())
		}
		// The nil marker can come before the last initial value (nats.go counts delivered
		// messages, which a consumer reset can inflate), so the load is done only once the
		// server also reports nothing pending, or the watcher has reached where the stream
		// ended when the watch began.
		if !caughtUp && marker && (pending == 0 || (startLast > 0 && seen >= startLast)) {
			caughtUp = true
			if resync {
				if n := t.sweep(); n > 0 {
					t.log.Info().Int("removed", n).Msg("groups re-watch removed devices no longer in the bucket")
				}
				if seen < t.rev.Load() {
					t.rev.Store(seen) // the bucket was recreated: its revisions started again
				}
			}
			t.markLoaded(created, startLast)
			t.markReady()
			t.log.Debug().Int("devices", t.Len()).Uint64("revision", t.Revision()).Bool("resync", resync).
				Msg("groups loaded")
		}
	}
	if ctx.Err() != nil {
		return caughtUp, nil
	}
	if err := context.Cause(wctx); err != nil {
		return caughtUp, err
	}
	return caughtUp, errWatchStopped
}

// check asks the server every check interval whether the bucket exists and the watcher keeps
// up, and cancels the watch with the reason when not. Errors reaching the server are ignored:
// the connection reconnects on its own and the watcher with it.
func (t *Table) check(ctx context.Context, cancel context.CancelCauseFunc, created time.Time) {
	ticker := time.NewTicker(t.checkEvery)
	defer ticker.Stop()
	var last, prevRev uint64 // as of the previous successful check
	checked := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		sctx, scancel := context.WithTimeout(ctx, max(t.checkEvery, time.Second))
		status, err := t.bucket.Status(sctx)
		scancel()
		if isNotFound(err) {
			cancel(fmt.Errorf("check bucket: %w", err))
			return
		}
		bs, ok := status.(*jetstream.KeyValueBucketStatus)
		if err != nil || !ok {
			continue
		}
		// The stream already held revision last one interval ago; if the watcher has neither
		// reached it nor delivered anything since, it is stuck. Each last revision triggers at
		// most one re-watch, so a last message removed without a marker (which no watcher will
		// ever deliver) cannot make every re-watch look stuck.
		info := bs.StreamInfo()
		if created.IsZero() {
			created = info.Created
		} else if !info.Created.Equal(created) {
			cancel(errBucketRecreated)
			return
		}
		if info.State.LastSeq < t.stalledAt {
			t.stalledAt = 0 // the stream's revisions started again
		}
		rev := t.watchRev.Load()
		if checked && rev < last && rev == prevRev && last > t.stalledAt {
			t.stalledAt = last
			cancel(fmt.Errorf("%w: revision %d written, watcher at %d", errWatchStalled, last, rev))
			return
		}
		last, prevRev, checked = info.State.LastSeq, rev, true
	}
}

// apply applies one watcher entry to the table.
func (t *Table) apply(e jetstream.KeyValueEntry, initial bool) {
	device, rev := e.Key(), e.Revision()
	switch e.Operation() {
	case jetstream.KeyValueDelete, jetstream.KeyValuePurge:
		if t.remove(device, rev) && t.onUpdate != nil {
			t.onUpdate(Update{Device: device, Entry: Entry{Revision: rev}, Deleted: true, Initial: initial})
		}
		return
	}
	entry := t.put(device, trimNewlines(e.Value()), rev)
	if entry.Invalid {
		t.warnInvalid(device, e.Value(), entry)
	}
	if t.onUpdate != nil {
		t.onUpdate(Update{Device: device, Entry: entry, Initial: initial})
	}
}

// warnInvalid logs a value the templates cannot use, at most once per second with a count of
// suppressed ones.
func (t *Table) warnInvalid(device string, value []byte, e Entry) {
	suppressed, ok := t.warn.Allow("invalid")
	if !ok {
		return
	}
	const maxShown = 64
	shown := value
	if len(shown) > maxShown {
		shown = shown[:maxShown]
	}
	ev := t.log.Warn().Str("device", device).Bytes("value", shown).Int("value_len", len(value)).
		Uint64("revision", e.Revision).Str("reason", e.Reason)
	if e.Field != "" {
		ev = ev.Str("field", e.Field)
	}
	ev.Str("why", e.Detail).Int("suppressed", suppressed).
		Msg("invalid device value: the templates cannot use it; its messages go to UNMAPPED with this reason (or are parked with --on-unmapped park) until it is fixed")
}
