package election

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/wire"
)

// slot is one partition's lease as the watch last showed it.
type slot struct {
	owner     string    // "" when unowned
	epoch     uint64    // revision of the claim by owner
	freeSince time.Time // when it was last seen unowned (monotonic); meaningful when owner == ""
	seen      time.Time // when the watch last showed the key (owners renew it every RenewInterval)
	lastOwner string    // the owner before it became unowned
	// rev and stored are the revision and the stream's timestamp of the key's last write the
	// watch showed: a takeover of a lease judged dead writes over rev (see [Config.JudgedExpiry]).
	rev    uint64
	stored time.Time
}

// heard is when the watch last showed a write: by this replica's clock when it arrived, and by
// the stream's timestamp when it was stored.
type heard struct {
	seen, stored time.Time
	// hears, for a member key, is when the last of the member's own writes that it had seen on its
	// watch was stored, as its heartbeat says (wire.MemberValue); zero when it says nothing.
	hears time.Time
}

// deaf reports whether a member's heartbeat h says it did not hear the bucket: its own writes
// seen on its watch stopped more than gap before the heartbeat was stored. Its writes reach the
// bucket but the bucket's answers and updates do not reach it (one direction of its connection
// is still down after a network cut), so it cannot take partitions handed to it.
func (h heard) deaf(gap time.Duration) bool {
	return !h.hears.IsZero() && h.stored.Sub(h.hears) > gap
}

// writable is the run of this replica's own control-bucket writes that the watch showed back to
// it with no gap longer than [Elector.ownGap] between two of them, by either clock: the time in
// which the bucket took writes and the watch delivered them (see [Config.JudgedExpiry]).
type writable struct {
	start, last heard // the first and the last write of the run; zero before any
}

// add extends the run with an own write heard at h, or starts a new one after a gap.
func (w *writable) add(h heard, gap time.Duration) {
	if w.last.seen.IsZero() || h.seen.Sub(w.last.seen) > gap || h.stored.Sub(w.last.stored) > gap {
		w.start = h
	}
	w.last = h
}

// silentFor returns for how long of the run, by the clock that says less, a key last written at
// h has not been written: from the later of h and the run's start to the run's last write.
func (w *writable) silentFor(h heard) time.Duration {
	if w.last.seen.IsZero() {
		return 0
	}
	seen := w.last.seen.Sub(later(h.seen, w.start.seen))
	stored := w.last.stored.Sub(later(h.stored, w.start.stored))
	return min(seen, stored)
}

// judgeableAt returns when, by this replica's clock, a key last written at h could first be
// judged silent for d, if this replica's writes go on being heard: zero before any own write.
func (w *writable) judgeableAt(h heard, d time.Duration) time.Time {
	if w.last.seen.IsZero() {
		return time.Time{}
	}
	return later(h.seen, w.start.seen).Add(d)
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// view is the bucket's members and leases as the watch shows them. The watch goroutine writes
// it; the Elector's loop reads copies.
type view struct {
	mu      sync.Mutex
	ready   bool             // the watch has delivered its initial values
	members map[string]heard // the live members, and when each last wrote its key
	slots   []slot
	own     writable // this replica's own writes, as the watch showed them
	// rev is the highest revision the current watch has delivered; unseen is the lowest
	// revision of this replica's own writes that the bucket acknowledged above it, and
	// unseenSince when that acknowledgement came: a watch that goes on not showing it has
	// stopped delivering (see [Elector.ownWriteAcked]).
	rev         uint64
	unseen      uint64
	unseenSince time.Time
	// live is set while a watch runs that has not been found stalled: a new one takes a
	// while to create (a consumer assigned through the meta leader), during which nothing it
	// could show may count against it.
	live bool
}

// delivered records that the watch showed revision rev.
func (v *view) delivered(rev uint64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.rev = max(v.rev, rev)
	if v.unseen != 0 && v.rev >= v.unseen {
		v.unseen = 0
	}
}

// reset forgets what a new watch replays from scratch. A partition stays free since when it
// was first seen free, so that a replay does not restart its Grace.
func (v *view) reset(partitions int, now time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.ready = false
	v.members = make(map[string]heard)
	v.rev, v.unseen, v.live = 0, 0, true
	// A new watch replays the bucket: what it shows of this replica's writes is not a run.
	v.own = writable{}
	old := v.slots
	v.slots = make([]slot, partitions)
	for i := range v.slots {
		s := slot{freeSince: now, seen: now}
		if i < len(old) {
			s.lastOwner = old[i].lastOwner
			if old[i].owner == "" {
				s.freeSince = old[i].freeSince
			} else {
				s.lastOwner = old[i].owner
			}
		}
		v.slots[i] = s
	}
}

// snapshot returns a copy of the view: whether it is ready, the live members with when each
// last wrote its key, the lease slots and the run of this replica's own writes.
func (v *view) snapshot() (bool, map[string]heard, []slot, writable) {
	v.mu.Lock()
	defer v.mu.Unlock()
	members := make(map[string]heard, len(v.members))
	for m, h := range v.members {
		members[m] = h
	}
	return v.ready, members, append([]slot(nil), v.slots...), v.own
}

// watch keeps the view current until ctx is done, re-creating the watch when it ends (the
// connection was closed) or when the loop asks for a resync.
func (e *Elector) watch(ctx context.Context) {
	for ctx.Err() == nil {
		if e.watchOnce(ctx) {
			continue
		}
		select {
		case <-ctx.Done():
		case <-time.After(e.cfg.RenewInterval):
		}
	}
}

// startWatch creates the watch, giving up after an ownGap; after three attempts in a row that
// failed, after an ownGap doubled for each further one (up to 8 ownGaps), so that a cluster
// slow to create consumers still gets a watch. Creating it creates a consumer, which the servers may place on a
// server that cannot answer (the one cut off from the bucket's leader, which made the last
// watch stall): the request would wait out its whole timeout (5 s) before the next attempt is
// placed again. Giving up cancels wctx, which ends the creation or, had it just succeeded,
// the watch it made.
func (e *Elector) startWatch(wctx context.Context) (jetstream.KeyWatcher, error) {
	type made struct {
		w   jetstream.KeyWatcher
		err error
	}
	got := make(chan made)
	e.goroutines.Go(func() {
		w, err := e.kv.WatchFiltered(wctx, []string{wire.LeaseFilter, wire.MemberFilter})
		select {
		case got <- made{w, err}:
		case <-wctx.Done():
			if w != nil {
				stopWatch(w)
			}
		}
	})
	limit := e.ownGap() << min(max(e.watchFails-2, 0), 3)
	t := time.NewTimer(limit)
	defer t.Stop()
	select {
	case m := <-got:
		return m.w, m.err
	case <-t.C:
		return nil, fmt.Errorf("no answer in %v to creating the watch's consumer", limit)
	case <-wctx.Done():
		return nil, wctx.Err()
	}
}

// watchOnce runs one KV watch until its Updates channel closes or a resync is asked for, in
// which case it reports true.
func (e *Elector) watchOnce(ctx context.Context) (resync bool) {
	// The watch's subscription outlives a closed connection until its context ends, so each
	// attempt gets its own.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := e.startWatch(wctx)
	if err != nil {
		e.watchFails++
		e.log.Warn().Err(err).Msg("watching the control bucket failed; retrying")
		return false
	}
	e.watchFails = 0
	e.view.reset(e.cfg.Partitions, time.Now())
	// A resync asked for while this watch was being created is what creating it did.
	select {
	case <-e.resync:
	default:
	}
	for {
		select {
		case ent, ok := <-w.Updates():
			if !ok {
				if ctx.Err() == nil {
					e.log.Warn().Msg("control bucket watch ended; restarting it")
				}
				return false
			}
			if ent == nil {
				e.view.mu.Lock()
				e.view.ready = true
				e.view.mu.Unlock()
				e.kickLoop()
				continue
			}
			e.apply(ent)
		case <-e.resync:
			e.log.Debug().Msg("resynchronising the control bucket watch")
			// Stopping deletes the watch's consumer, which waits for the server holding it:
			// up to the request timeout when that server is cut off (the stalled watch
			// ownWriteAcked replaces). The new watch starts at once; the old one is stopped
			// beside it. The subscription's callback may be blocked sending to Updates: drain
			// until its close handler closes the channel so that its goroutine can exit.
			e.goroutines.Go(func() { stopWatch(w) })
			return true
		case <-ctx.Done():
			// nats.go ends the watch with its context and then closes Updates, which the
			// case above sees; this case is for when it does not (see stopWatch).
			e.goroutines.Go(func() { stopWatch(w) })
			return false
		}
	}
}

// stopWatchDrain bounds how long stopWatch drains a stopped watch whose Updates stay open.
const stopWatchDrain = 5 * time.Second

// stopWatch stops w and drains its Updates, so that a subscription callback blocked sending to
// it can return, until nats.go closes the channel — or for stopWatchDrain at most. nats.go
// closes Updates from the subscription's close handler, which WatchFiltered sets only after the
// subscription exists: when the watch's context ends between the two, the subscription is
// closed before it has a handler and Updates is never closed. An unbounded drain would then
// keep Run's goroutines (and Run) from ever returning.
func stopWatch(w jetstream.KeyWatcher) {
	_ = w.Stop()
	t := time.NewTimer(stopWatchDrain)
	defer t.Stop()
	for {
		select {
		case _, ok := <-w.Updates():
			if !ok {
				return
			}
		case <-t.C:
			return
		}
	}
}

// ownWriteAcked notes that the bucket stored one of this replica's own watched writes (a lease
// renewal, a member heartbeat) at revision rev, and asks for a new watch when one it stored
// more than [Elector.ownGap] ago has still not come back on the watch.
//
// The watch is an R1 consumer, which the servers place on any replica of the bucket's stream,
// not only its leader. When that server loses its route to the leader (the others still
// committing without it), the watch stops delivering: its server's copy of the stream takes no
// new writes, or its deliveries cannot reach this replica. Its writes still succeed, so
// nothing else notices, but the watch shows none of them: no writable time is counted, and a
// silent owner is never judged dead (seen: a lost route kept every takeover waiting for the
// lease TTL, tries in a row). A new watch is a new consumer, placed again; a replica whose
// own writes stop being acknowledged is not asking for one (it has nothing to compare with).
func (e *Elector) ownWriteAcked(rev uint64) {
	now := time.Now()
	v := &e.view
	v.mu.Lock()
	if v.live && rev > v.rev && v.unseen == 0 {
		v.unseen, v.unseenSince = rev, now
	}
	stalled := v.live && v.unseen != 0 && now.Sub(v.unseenSince) > e.ownGap()
	lag := v.unseen
	if stalled {
		v.unseen, v.live = 0, false
	}
	v.mu.Unlock()
	if !stalled {
		return
	}
	e.stalls.Add(1)
	if n, ok := e.stallLog.Allow("stall"); ok {
		e.log.Warn().Uint64("unseen_revision", lag).Dur("after", e.ownGap()).Int("suppressed", n).
			Msg("the control bucket watch stopped showing this replica's own writes (its consumer may sit on a server cut off from the bucket's leader); starting a new watch")
	}
	select {
	case e.resync <- struct{}{}:
	default:
	}
}

// apply folds one watch entry into the view, wakes the loop when ownership or membership changed
// and reports ownership changes.
func (e *Elector) apply(ent jetstream.KeyValueEntry) {
	e.view.delivered(ent.Revision())
	key := ent.Key()
	gone := ent.Operation() != jetstream.KeyValuePut
	now := time.Now()
	kind, p, id, ok := wire.ParseControlKey(key)
	if !ok {
		return
	}
	h := heard{seen: now, stored: ent.Created()}
	if kind == wire.KindMember {
		e.view.mu.Lock()
		prev, had := e.view.members[id]
		if gone {
			delete(e.view.members, id)
		} else {
			_, h.hears = wire.ParseMemberValue(ent.Value())
			e.view.members[id] = h
			if had && id != e.cfg.ReplicaID && prev.deaf(e.deafAfter()) != h.deaf(e.deafAfter()) {
				// It can take partitions again, or not: the quotas change.
				defer e.kickLoop()
			}
			if id == e.cfg.ReplicaID && e.view.ready {
				e.view.own.add(h, e.ownGap())
				if e.cfg.JudgedExpiry > 0 {
					// More writable time: some silent owner may now be judged dead.
					defer e.kickLoop()
				}
			}
		}
		e.view.mu.Unlock()
		if had == gone {
			e.log.Debug().Str("member", id).Bool("joined", !gone).Msg("membership changed")
			e.kickLoop()
		}
		return
	}
	if kind != wire.KindLease || p >= e.cfg.Partitions {
		return
	}
	owner := ""
	if !gone {
		owner = string(ent.Value())
	}
	e.view.mu.Lock()
	ready := e.view.ready
	if owner == e.cfg.ReplicaID && ready {
		e.view.own.add(h, e.ownGap())
	}
	s := &e.view.slots[p]
	old := *s
	var ch Change
	changed := old.owner != owner
	switch {
	case !changed:
		s.seen = now
	case owner == "":
		*s = slot{freeSince: now, seen: now, lastOwner: old.owner}
		ch = Change{Partition: p, OldOwner: old.owner, At: now}
	default:
		prev := old.owner
		var unowned time.Duration
		if prev == "" {
			prev, unowned = old.lastOwner, now.Sub(old.freeSince)
		}
		*s = slot{owner: owner, epoch: ent.Revision(), seen: now}
		ch = Change{Partition: p, OldOwner: prev, NewOwner: owner, Epoch: ent.Revision(), Unowned: unowned, At: now}
	}
	s.rev, s.stored = ent.Revision(), h.stored
	e.view.mu.Unlock()
	if !changed {
		return
	}
	e.log.Debug().Int("partition", p).Str("old_owner", ch.OldOwner).Str("new_owner", ch.NewOwner).
		Uint64("epoch", ch.Epoch).Int64("unowned_ms", ms(ch.Unowned)).Msg("ownership change observed")
	// The initial replay shows the state, not changes.
	if e.cfg.OnChange != nil && ready {
		e.cfg.OnChange(ch)
	}
	e.kickLoop()
}
