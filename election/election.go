package election

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/internal/ratelog"
	"github.com/kvmapper/kvmapper/wire"
)

// graceHold is how many lease TTLs a partition claimed past Grace, beyond this replica's quota,
// is kept before it may be handed back to a member under its quota.
const graceHold = 5

// inTransit stands in [Plan]'s owners for a partition the view still shows as this replica's
// although it holds no lease for it any more (its lease was lost or its delete is not seen yet):
// owned, but by no member. It cannot be a replica id.
const inTransit = "?"

// Work runs a partition while this replica owns it. ctx is done when the lease is lost
// (context.Cause(ctx) is [ErrLeaseLost]) or is being released (Cause is [ErrReleased]) — on
// rebalance or shutdown. On release the [Elector] keeps renewing the lease and waits for Work to
// return (up to ReleaseTimeout) before deleting the lease, so Work can drain in-flight work and
// write its final checkpoint. A Work that returns while its ctx is alive gives the partition up:
// the lease is released, a non-nil error is logged, and this replica reclaims the partition only
// after a backoff; unless the error wraps [ErrLeaseLost] (the work found a newer owner's fence),
// which ends the lease as a lost one: nothing is deleted. Work runs on its own goroutine, one per owned partition; the partition is not
// claimed again by this replica until Work has returned.
type Work func(ctx context.Context, l *Lease) error

// Elector takes part in the election of partition owners for one replica. Create it with [New]
// and run it with [Elector.Run]; [Elector.Owned] is safe for concurrent use.
type Elector struct {
	js   jetstream.JetStream
	kv   jetstream.KeyValue
	work Work
	cfg  Config
	log  zerolog.Logger

	memberKey     string
	memberSubject string
	leasePrefix   string // "$KV.<bucket>.lease."

	view     view
	kick     chan struct{} // wakes the loop; capacity 1
	resync   chan struct{} // asks the watch goroutine to replay the bucket; capacity 1
	exits    chan exit     // holders report here; capacity Partitions
	stopping chan struct{} // closed by Run when it starts shutting down
	owned    atomic.Pointer[[]int]
	// stalls counts the watches replaced because they stopped showing this replica's own
	// writes ([Elector.ownWriteAcked]); stallLog keeps a lasting stall to a line a minute.
	stalls   atomic.Int64
	stallLog ratelog.Limiter
	// watchFails counts the watches that could not be created in a row; the watch goroutine's.
	watchFails int
	running    atomic.Bool
	// goroutines are the watch and the holders' Work runs that Run started; Run waits for them.
	goroutines sync.WaitGroup

	// Owned by the loop goroutine.
	passes   int // the loop's passes, for tests
	holders  map[int]*holder
	failures map[int]int       // consecutive Work failures per partition
	cooldown map[int]time.Time // no claim before this time
	// claimed, handing and released gather what one pass of the loop did, so that a start
	// claiming every partition, a rebalance or a shutdown logs one line, not one per partition
	// (see logPass); each partition's own line is at debug level.
	claimed  []claimed
	handing  []int
	released []int
	// unanswered are the claims whose outcome is not known yet, by partition (see claim).
	unanswered map[int]unanswered
	// adverts are what the last write of a lease judged silent carried in its checkedHeader,
	// by partition, read once per revision (see mayJudge).
	adverts map[int]advert
	settle  settle
}

// settle tracks the start-up wait for the member set to settle; owned by the loop goroutine.
type settle struct {
	done    bool
	start   time.Time // when the view was first ready
	members string    // the sorted member set last seen, joined
	since   time.Time // when members last changed
}

// New returns an Elector for the replica cfg.ReplicaID. js must be the JetStream context the
// bucket was opened with: renewals publish to the bucket's subjects directly, because
// jetstream.KeyValue cannot renew a key without dropping its per-key TTL. The bucket must be
// local to js (no domain or mirror). New does no I/O; it returns an error wrapping
// [ErrInvalidConfig] when cfg is invalid or a dependency is nil.
func New(js jetstream.JetStream, bucket jetstream.KeyValue, work Work, cfg Config) (*Elector, error) {
	if js == nil || bucket == nil || work == nil {
		return nil, fmt.Errorf("%w: js, bucket and work are required", ErrInvalidConfig)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	e := &Elector{
		js:            js,
		kv:            bucket,
		work:          work,
		cfg:           cfg,
		log:           cfg.Logger.With().Str("replica", cfg.ReplicaID).Logger(),
		memberKey:     wire.MemberKey(cfg.ReplicaID),
		memberSubject: "$KV." + bucket.Bucket() + "." + wire.MemberKey(cfg.ReplicaID),
		leasePrefix:   "$KV." + bucket.Bucket() + ".",
		kick:          make(chan struct{}, 1),
		resync:        make(chan struct{}, 1),
		exits:         make(chan exit, cfg.Partitions),
		stopping:      make(chan struct{}),
		holders:       make(map[int]*holder),
		failures:      make(map[int]int),
		cooldown:      make(map[int]time.Time),
		unanswered:    make(map[int]unanswered),
		adverts:       make(map[int]advert),
		stallLog:      ratelog.Limiter{Every: time.Minute},
	}
	e.owned.Store(&[]int{})
	return e, nil
}

// WatchStalls returns how many times this replica replaced its control bucket watch because the
// bucket stored its own writes and the watch did not show them (its consumer cut off from the
// bucket's leader). It is safe for concurrent use.
func (e *Elector) WatchStalls() int64 { return e.stalls.Load() }

// Owned returns the sorted partitions this replica currently holds a lease for, including ones
// being handed over whose Work has not returned yet. The caller may modify the slice. It is
// safe for concurrent use.
func (e *Elector) Owned() []int {
	return slices.Clone(*e.owned.Load())
}

// Run takes part in the election until ctx is done, then leaves gracefully: it deletes its
// member key (so the others recompute their quotas without it), cancels every Work with [ErrReleased], waits for
// each (up to ReleaseTimeout), deletes each lease with a revision check, and returns nil. It
// returns an error if it cannot start (the bucket lacks per-key TTL support, or the member key
// cannot be written). It returns only after every goroutine it started has exited, except a Work
// that ignored its context past ReleaseTimeout, which is abandoned and logged. Run may be called
// only once.
func (e *Elector) Run(ctx context.Context) error {
	if !e.running.CompareAndSwap(false, true) {
		return errors.New("election: Run called twice")
	}
	st, err := e.kv.Status(ctx)
	if err != nil {
		return fmt.Errorf("election: reading bucket status: %w", err)
	}
	if st.LimitMarkerTTL() <= 0 {
		return fmt.Errorf("%w: bucket %s has no LimitMarkerTTL, which per-key TTLs need", ErrInvalidConfig, e.kv.Bucket())
	}
	if err := e.join(ctx); err != nil {
		return err
	}

	watchCtx, stopWatch := context.WithCancel(context.WithoutCancel(ctx))
	e.goroutines.Go(func() { e.watch(watchCtx) })
	hbCtx, stopHeartbeat := context.WithCancel(ctx)
	hbDone := make(chan struct{})
	go func() { defer close(hbDone); e.heartbeat(hbCtx) }()

	e.loop(ctx)

	// Leave the membership first, so that the others recompute their quotas without this
	// replica and claim each partition the moment its lease is deleted instead of after Grace.
	stopHeartbeat()
	<-hbDone
	e.leave()
	close(e.stopping)
	for len(e.holders) > 0 {
		e.exited(<-e.exits)
	}
	stopWatch()
	e.goroutines.Wait()
	return nil
}

// loop claims and releases partitions until ctx is done.
func (e *Elector) loop(ctx context.Context) {
	tick := time.NewTicker(e.cfg.LeaseTTL)
	defer tick.Stop()
	wake := time.NewTimer(time.Hour)
	defer wake.Stop()
	ticks := 0
	for {
		e.passes++
		if next := e.reconcile(ctx); !next.IsZero() {
			wake.Reset(max(time.Until(next), minWake))
		}
		select {
		case <-ctx.Done():
			return
		case <-e.kick:
		case x := <-e.exits:
			e.exited(x)
		case <-tick.C:
			ticks++
			if ticks%resyncTicks == 0 || e.stale() {
				select {
				case e.resync <- struct{}{}:
				default:
				}
			}
		case <-wake.C:
		}
	}
}

// minWake is the soonest the loop wakes itself for a time reconcile asked for. That time can be
// past already: a key becomes judgeable by this replica's clock "if its own writes go on being
// heard" (writable.judgeableAt), and while they are not (a control-bucket election, a stalled
// watch, a replica cut off) the key is not judged when the time comes, and the time stays past.
// Woken at once for it, the loop ran again at once, for as long as its own writes went unheard:
// a core spent, and a claim sent each pass for a partition the frozen view showed free. An own
// write heard kicks the loop anyway.
const minWake = 100 * time.Millisecond

// resyncTicks is how many safety-net ticks (one per LeaseTTL) pass between unconditional
// replays of the bucket.
const resyncTicks = 15

// stale reports whether the view shows a lease that has not been renewed for longer than a
// renewal plus its TTL: the watch missed its expiry (as when a key expires while the server is
// down: no marker reaches the watch) or has stopped delivering.
func (e *Elector) stale() bool {
	e.view.mu.Lock()
	defer e.view.mu.Unlock()
	if !e.view.ready {
		return false
	}
	for _, s := range e.view.slots {
		if s.owner != "" && time.Since(s.seen) > e.cfg.LeaseTTL+e.cfg.RenewInterval {
			return true
		}
	}
	return false
}

// ownGap is the longest gap between two of this replica's own writes seen on the watch that
// still counts as one run of writable time (see [Config.JudgedExpiry]).
func (e *Elector) ownGap() time.Duration { return 3 * e.cfg.RenewInterval }

// deafAfter is how long before its heartbeat was stored a member may have last seen its own
// writes on its watch and still be counted in the quotas (see [heard.deaf]): twice ownGap, so
// that a watch a loaded machine delays does not drop a member, while one that hears nothing
// after a network cut (for as long as the cut lasted) is left out until it hears again.
func (e *Elector) deafAfter() time.Duration { return 2 * e.ownGap() }

// judged reports whether a key last written at h (a lease, a member) has been silent for
// JudgedExpiry of writable time: its owner is taken for dead.
func (e *Elector) judged(own writable, h heard) bool {
	return e.cfg.JudgedExpiry > 0 && own.silentFor(h) >= e.cfg.JudgedExpiry
}

// judgeable returns when a key last written at h could be judged dead if this replica's own
// writes go on being heard, and zero without JudgedExpiry or before any own write is heard.
func (e *Elector) judgeable(own writable, h heard) time.Time {
	if e.cfg.JudgedExpiry <= 0 {
		return time.Time{}
	}
	return own.judgeableAt(h, e.cfg.JudgedExpiry)
}

// advert is what one write of a lease carried in its checkedHeader.
type advert struct {
	rev     uint64
	checked string
	judge   bool // Config.Judge accepted it
}

// mayJudge reports whether partition p's lease, silent at revision s.rev for JudgedExpiry, may
// be taken over before it expires ([Config.Judge]): what its owner's last write vouched for is
// read from the bucket's leader (the watch does not show headers), once per revision. A read
// that fails says no, until the next pass reads again.
func (e *Elector) mayJudge(ctx context.Context, p int, s slot) bool {
	if e.cfg.Judge == nil {
		return true
	}
	if a, ok := e.adverts[p]; ok && a.rev == s.rev {
		return a.judge
	}
	rctx, cancel := context.WithTimeout(ctx, e.cfg.RenewInterval)
	defer cancel()
	m, err := kvcas.AtSeq(rctx, e.js, "KV_"+e.kv.Bucket(), s.rev)
	if err != nil {
		// Gone (written since, or expired): the watch shows what came after.
		e.log.Debug().Err(err).Int("partition", p).Uint64("revision", s.rev).Msg("reading a silent lease's last write failed")
		return false
	}
	a := advert{rev: s.rev, checked: m.Header.Get(checkedHeader)}
	a.judge = m.Subject == e.leasePrefix+wire.LeaseKey(p) && e.cfg.Judge(a.checked)
	e.adverts[p] = a
	if !a.judge {
		e.log.Info().Int("partition", p).Str("owner", s.owner).Str("checked", a.checked).
			Msg("owner silent for the judged expiry, but its writes are not known to be refused after a takeover (it does not advertise fence-checked writes this replica can vouch for, as an older build): leaving its lease to expire")
	}
	return a.judge
}

// kickLoop wakes the loop without blocking.
func (e *Elector) kickLoop() {
	select {
	case e.kick <- struct{}{}:
	default:
	}
}

// reconcile compares the view with the desired ownership computed by [Plan]: it asks holders of
// partitions beyond this replica's quota to hand over, claims free partitions up to the quota,
// claims any partition unowned longer than Grace, and tries again the claims whose answer was
// lost. It returns when it next needs to run (zero if only events matter).
func (e *Elector) reconcile(ctx context.Context) time.Time {
	ready, live, slots, own := e.view.snapshot()
	if !ready {
		return time.Time{}
	}
	now := time.Now()
	var next time.Time
	later := func(t time.Time) {
		if !t.IsZero() && (next.IsZero() || t.Before(next)) {
			next = t
		}
	}
	me := e.cfg.ReplicaID
	members := make([]string, 0, len(live)+1)
	members = append(members, me)
	for m, h := range live {
		if m == me {
			continue
		}
		if e.judged(own, h) {
			continue // left out of the quotas: it has been silent for JudgedExpiry
		}
		if h.deaf(e.deafAfter()) {
			continue // left out of the quotas: it writes the bucket but does not hear it
		}
		later(e.judgeable(own, h))
		members = append(members, m)
	}
	slices.Sort(members)
	// The holders, not the watch, say what this replica owns: the watch lags behind claims,
	// and counting a fresh claim as free would make Plan claim past the quota. A lease judged
	// dead counts as free, since when it was judged; claiming it writes over its last revision.
	owners := make([]string, len(slots))
	for p, s := range slots {
		owners[p] = s.owner
		h := heard{seen: s.seen, stored: s.stored}
		switch {
		case s.owner == me:
			owners[p] = inTransit
		case s.owner == "":
		case e.judged(own, h):
			if !e.mayJudge(ctx, p, s) {
				// Left to expire on the server: its purge marker wakes the loop.
				continue
			}
			owners[p] = ""
			slots[p].freeSince = e.judgeable(own, h)
		default:
			later(e.judgeable(own, h))
		}
	}
	for p, h := range e.holders {
		if h.gone.Load() {
			// Its lease is lost and its Work still returning: not this replica's share any more,
			// or a replica back from a cut, its five lanes draining for 10 s, would count them in
			// its quota and claim nothing handed to it, and the others would claim its share again
			// after Grace and keep it for graceHold (a clean-clone CI run on 2026-12-07: 75 s
			// without a partition). Nor may this replica claim it again before Work returned: a
			// free one stays in transit.
			if owners[p] == "" || owners[p] == me {
				owners[p] = inTransit
			}
			continue
		}
		owners[p] = me
	}
	claims, releases := Plan(me, members, owners)

	// Partitions already being handed over count towards the excess, whichever they are. A
	// partition claimed past Grace is kept for a while rather than swapped for another, so
	// that a member that cannot run it (its Work keeps failing) does not make it bounce every
	// Grace.
	excess := len(releases)
	for _, h := range e.holders {
		if h.releasing {
			excess--
		}
	}
	for _, p := range releases {
		h := e.holders[p]
		if excess <= 0 {
			break
		}
		if h.releasing {
			continue
		}
		excess--
		if now.Before(h.keepUntil) {
			later(h.keepUntil)
			continue
		}
		h.releasing = true
		close(h.release)
		e.log.Debug().Int("partition", p).Uint64("epoch", h.lease.Epoch).Msg("handing partition over for rebalance")
		e.handing = append(e.handing, p)
	}
	if len(e.handing) > 0 {
		slices.Sort(e.handing)
		e.log.Info().Ints("partitions", e.handing).Int("quota", Quota(len(owners), members, me)).
			Int("members", len(members)).Msg("handing partitions over for rebalance")
		e.handing = e.handing[:0]
	}

	if ctx.Err() != nil {
		return next
	}
	if until := e.settling(now, members, slots); !until.IsZero() {
		later(until)
		return next
	}
	// Planned claims go first, in Plan's order of preference, so that replicas claiming at the
	// same time mostly go for different partitions.
	planned := make(map[int]bool, len(claims))
	cooling := func(p int) bool {
		until, ok := e.cooldown[p]
		if ok && now.Before(until) {
			later(until)
			return true
		}
		return false
	}
	for _, p := range claims {
		planned[p] = true
		if !cooling(p) {
			e.claim(ctx, p, slots[p], true)
		}
	}
	for p, s := range slots {
		if owners[p] != "" || planned[p] || cooling(p) {
			continue
		}
		if now.Sub(s.freeSince) < e.cfg.Grace {
			later(s.freeSince.Add(e.cfg.Grace))
			continue
		}
		e.claim(ctx, p, s, false)
	}
	if t := e.retryUnanswered(ctx, now, slots); !t.IsZero() {
		later(t)
	}
	e.logClaimed()
	return next
}

// claimed is one partition a pass of the loop claimed.
type claimed struct {
	p          int
	from       string // the previous owner, if any
	unowned    time.Duration
	answerLost bool
	takenOver  bool // from an owner judged dead (Config.JudgedExpiry)
}

// logClaimed logs, in one line, the partitions the pass claimed: which, from whom, the longest
// any of them was unowned, and how many were found rather than acknowledged (an answer lost).
func (e *Elector) logClaimed() {
	if len(e.claimed) == 0 {
		return
	}
	var ps []int
	var from []string
	var longest time.Duration
	lost, taken := 0, 0
	for _, c := range e.claimed {
		if c.takenOver {
			taken++
		}
		ps = append(ps, c.p)
		if c.from != "" && !slices.Contains(from, c.from) {
			from = append(from, c.from)
		}
		longest = max(longest, c.unowned)
		if c.answerLost {
			lost++
		}
	}
	slices.Sort(ps)
	slices.Sort(from)
	ev := e.log.Info().Ints("partitions", ps).Int("owned", len(e.holders)).Int64("unowned_ms", ms(longest))
	if len(from) > 0 {
		ev = ev.Strs("old_owners", from)
	}
	if lost > 0 {
		ev = ev.Int("answer_lost", lost)
	}
	if taken > 0 {
		ev = ev.Int("taken_over", taken)
	}
	ev.Msg("partitions claimed")
	e.claimed = e.claimed[:0]
}

// logReleased logs, in one line, the partitions released since the last such line, once none
// is being released any more: after a rebalance's releases, or every release of a shutdown.
func (e *Elector) logReleased() {
	if len(e.released) == 0 {
		return
	}
	select {
	case <-e.stopping:
		if len(e.holders) > 0 {
			return
		}
	default:
		for _, h := range e.holders {
			if h.releasing {
				return
			}
		}
	}
	slices.Sort(e.released)
	e.log.Info().Ints("partitions", e.released).Int("owned", len(e.holders)).Msg("partitions released")
	e.released = e.released[:0]
}

// ms is d in whole milliseconds, rounded: the unit of every duration kvmapper logs (a field
// named …_ms).
func ms(d time.Duration) int64 { return d.Round(time.Millisecond).Milliseconds() }

// settling returns until when this replica waits, at start, for the member set to settle before
// it claims free partitions, or zero once it may claim. It waits until the member set has not
// changed for Settle, at most 4×Settle after the view was first ready, and not at all if every
// partition was owned then: replicas started together then split the partitions by their quotas
// at once, instead of the first one claiming them all and handing most of them back.
func (e *Elector) settling(now time.Time, members []string, slots []slot) time.Time {
	st := &e.settle
	if st.done {
		return time.Time{}
	}
	if st.start.IsZero() {
		st.start = now
		st.done = !slices.ContainsFunc(slots, func(s slot) bool { return s.owner == "" })
		if st.done {
			return time.Time{}
		}
	}
	if sig := strings.Join(members, ","); sig != st.members || st.since.IsZero() {
		st.members, st.since = sig, now
	}
	until := st.since.Add(e.cfg.Settle)
	if limit := st.start.Add(4 * e.cfg.Settle); limit.Before(until) {
		until = limit
	}
	if now.Before(until) {
		return until
	}
	st.done = true
	e.log.Debug().Strs("members", members).Int64("after_ms", ms(now.Sub(st.start))).Msg("member set settled")
	return time.Time{}
}

// exited forgets a holder that ended and schedules a backoff after a Work failure.
func (e *Elector) exited(x exit) {
	delete(e.holders, x.p)
	e.publishOwned()
	if x.kind == exitReleased {
		e.released = append(e.released, x.p)
	}
	switch x.kind {
	case exitFailed:
		e.failures[x.p]++
		backoff := min(e.cfg.LeaseTTL<<min(e.failures[x.p]-1, 5), 30*time.Second)
		e.cooldown[x.p] = time.Now().Add(backoff)
	default:
		delete(e.failures, x.p)
		delete(e.cooldown, x.p)
	}
	e.logReleased()
	e.kickLoop()
}

// publishOwned stores a fresh snapshot of the owned partitions for Owned.
func (e *Elector) publishOwned() {
	ps := make([]int, 0, len(e.holders))
	for p := range e.holders {
		ps = append(ps, p)
	}
	slices.Sort(ps)
	e.owned.Store(&ps)
}

// join writes the member key. A key that already exists belongs to an earlier run of this
// replica that did not leave cleanly, or to another replica with the same id; either way this
// replica takes it over and says so.
func (e *Elector) join(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, e.cfg.LeaseTTL)
	defer cancel()
	_, err := e.kv.Create(cctx, e.memberKey, []byte(e.cfg.ReplicaID), jetstream.KeyTTL(e.cfg.MemberTTL))
	if kvcas.IsConflict(err) {
		e.log.Warn().Msg("member key already exists: an earlier run that did not leave, or a duplicate replica id")
		err = e.putMember(cctx)
	}
	if err != nil {
		return fmt.Errorf("election: writing member key %s: %w", e.memberKey, err)
	}
	return nil
}

// heartbeat renews the member key every RenewInterval until ctx is done.
func (e *Elector) heartbeat(ctx context.Context) {
	t := time.NewTicker(e.cfg.RenewInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			timeout := e.cfg.MemberTTL - e.cfg.RenewInterval
			if e.cfg.JudgedExpiry > 0 {
				// The others judge this replica by its heartbeats: one stuck waiting for a dead
				// leader's answer would leave it silent after an election.
				timeout = e.cfg.RenewInterval
			}
			cctx, cancel := context.WithTimeout(ctx, timeout)
			if err := e.putMember(cctx); err != nil && ctx.Err() == nil {
				e.log.Debug().Err(err).Msg("member heartbeat failed")
			}
			cancel()
		}
	}
}

// putMember writes the member key with its TTL. There is no compare-and-set: the key only says
// "alive", and a heartbeat must recreate it if it expired during a network blip.
func (e *Elector) putMember(ctx context.Context) error {
	msg := nats.NewMsg(e.memberSubject)
	e.view.mu.Lock()
	heard := e.view.own.last.stored
	e.view.mu.Unlock()
	msg.Data = wire.MemberValue(e.cfg.ReplicaID, heard)
	ack, err := e.js.PublishMsg(ctx, msg, jetstream.WithMsgTTL(e.cfg.MemberTTL))
	if err != nil {
		return err
	}
	e.ownWriteAcked(ack.Sequence)
	return nil
}

// leave deletes the member key; run after the heartbeat has stopped.
func (e *Elector) leave() {
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.LeaseTTL)
	defer cancel()
	if err := e.kv.Delete(ctx, e.memberKey); err != nil {
		e.log.Warn().Err(err).Msg("deleting member key failed; it will expire")
	}
}
