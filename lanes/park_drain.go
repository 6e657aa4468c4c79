package lanes

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/ordered"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// A drain reads one parked device's messages back from PARKED, in order, with an ordered
// consumer on the device's subject fed to the lane like its main reader, and republishes each:
// to OUTGOING with the device's group (a release), or to UNMAPPED with a reason (past the
// maximum age, or by hand). Its publishes take room in the pool's window like the lane's own,
// and keep their own queue, which never moves the checkpoint: the messages were checkpointed
// when PARKED stored them.
//
// Each drain publishes through a writer of its own (package ordered), answered on the lane's
// inbox: after any failure it sends nothing new until every publish in flight has settled, then
// resends, in order, everything not stored, so a drain keeps the device's order under the same
// rule as the lane. Its first messages go one at a time until one is stored as new: a drain cut
// short and resumed resends what was stored and not purged, and those are counted as the
// duplicates they are.
//
// What a drain has seen acknowledged it purges from PARKED, every PurgeInterval and when it
// ends; a drain cut short (its owner killed) and resumed by the next owner resends what was
// acknowledged but not purged yet. OUTGOING drops those by their Nats-Msg-Id within its duplicate
// window; a resume later than that stores them again (at most PurgeInterval of release traffic
// plus the publishes in flight). A purge by subject costs the server about as much per message
// as storing it (per-subject index and tombstone) and holds the stream while it runs: purging at
// every tick of every drain stalled PARKED for seconds in a mass release. A drain does not skip what OUTGOING holds by looking at the
// device's last message there: a message lost by a stream's leader change while later ones were
// stored would then be skipped for good, and a loss is worse than a duplicate.

// drainMode says what a drain does with each parked message.
type drainMode uint8

const (
	// drainRelease republishes each message with the device's group; it stops, the device still
	// parked, when the device has none.
	drainRelease drainMode = iota + 1
	// drainExpire dead-letters each message older than MaxAge as park-expired and stops at the
	// first younger one.
	drainExpire
	// drainForce (unpark) republishes each with the device's group, or dead-letters it with the
	// reason its lookup gives.
	drainForce
	// drainDrop (unpark --drop) dead-letters each as park-dropped.
	drainDrop
)

// drainPull is how many parked messages a drain's consumer asks for at once.
const drainPull = 64

// drainIdle is how long a drain that waits for a message PARKED should hold, with nothing in
// flight, waits before it reads where the device stands again: a message purged by a deposed
// owner after this drain started is never delivered.
const drainIdle = 5 * time.Second

// drain is one device's drain, owned by the lane's goroutine.
type drain struct {
	id   uint64
	dev  *parkedDevice
	mode drainMode

	readerGen uint64             // bumped whenever its reader is started or stopped
	cancel    context.CancelFunc // stops the reader; nil when none runs
	want      chan struct{}      // capacity 1: the lane takes one more message

	started bool   // the reader read where the device stands: l0 is known
	l0      uint64 // the device's last PARKED sequence then

	w        *ordered.Writer // its publishes: OUTGOING and UNMAPPED
	q        []*drainEntry   // in flight, in PARKED order: the entries of w's queue, one for one
	held     *drainEntry     // built, waiting for room in the window
	last     uint64          // the PARKED sequence of the last message handed to w
	through  uint64          // every message of the device up to this PARKED sequence is done
	purgedTo uint64          // through, when a purge was last queued
	purgedAt time.Time       // when
	progress time.Time       // when through last moved, or the drain (re)started
	retryAt  time.Time       // after a failure: when to resend; zero when not waiting

	stopping bool      // its reader stopped at a message it must not send: finish once settled
	stopAt   time.Time // when that message was parked
}

// refusal is how a drained message is sent after the stream refused it for good: level 1 as a
// dead letter with reason, 2 stripped to its reason, 3 not at all (given up, counted as dropped).
type refusal struct {
	level  int
	reason string
	why    string
}

// drainEntry is one drained message on its way out.
type drainEntry struct {
	om     ordered.Msg   // Key is the PARKED sequence; Out is msg
	seq    uint64        // PARKED sequence
	src    jetstream.Msg // the parked message, to rebuild a dead letter from
	at     time.Time     // when it was parked
	msg    nats.Msg
	reason string // non-empty for a dead letter
	ref    refusal
	cost   int64
	room   bool // it holds cost of the pool's window (not while its drain pauses after a failure)
}

// startDrain starts draining dev in mode.
func (l *lane) startDrain(ctx context.Context, dev *parkedDevice, mode drainMode) {
	s := l.park
	s.nextID++
	// A drain cut short (its owner killed) resends what was stored and not purged: counted as
	// the duplicates they are, one at a time until the first new store (newWriter). On a
	// stream written singly, too, the first goes alone: a release whose publishes hang holds
	// one message of the window, not all the room the device's new parks need
	// (TestParkThenReleaseInOrder).
	d := &drain{id: s.nextID, dev: dev, mode: mode, purgedAt: time.Now(), w: l.newWriter(ctx, outParked)}
	d.w.ProbeAll()
	dev.drain = d
	s.drains[d.id] = d
	l.log.Debug().Str("device", dev.name).Uint8("mode", uint8(mode)).Msg("draining a parked device")
	l.startReader(ctx, d, 0)
}

// startReader starts d's reader at PARKED sequence from (0: the device's first message).
func (l *lane) startReader(ctx context.Context, d *drain, from uint64) {
	s := l.park
	d.stopReader()
	rctx, cancel := context.WithCancel(ctx)
	d.cancel = cancel
	d.want = make(chan struct{}, 1)
	d.want <- struct{}{}
	d.progress = time.Now()
	id, gen, want, device, start := d.id, d.readerGen, d.want, d.dev.name, !d.started
	s.wg.Go(func() { l.readParked(rctx, id, gen, device, from, start, want) })
}

// stopReader stops d's reader; what it sent meanwhile is ignored.
func (d *drain) stopReader() {
	d.readerGen++
	if d.cancel != nil {
		d.cancel()
		d.cancel = nil
	}
}

// giveToken lets d's reader hand on one more message.
func (d *drain) giveToken() {
	select {
	case d.want <- struct{}{}:
	default:
	}
}

// drainMsg takes one message from d's reader.
func (l *lane) drainMsg(d *drain, m jetstream.Msg, seq uint64, at time.Time) {
	if seq <= d.last || seq <= d.through {
		d.giveToken()
		return
	}
	if d.stopping {
		d.stopReader()
		return
	}
	e := &drainEntry{seq: seq, src: m, at: at}
	if !l.fillDrained(d, e, false) {
		d.stopping, d.stopAt = true, at
		d.stopReader()
		l.drainCheck(d)
		return
	}
	d.held = e
	l.drainAdmit(d)
}

// fillDrained makes e what to publish for its parked message, at its refusal level. It returns
// false when d stops before it (unless rebuild: a refused message made over): a release whose
// device has no group, or an expiry that reached a message young enough.
func (l *lane) fillDrained(d *drain, e *drainEntry, rebuild bool) bool {
	hdr := nats.Header{}
	for k, v := range e.src.Headers() {
		hdr[k] = v
	}
	ref := e.ref
	var mp subjects.Mapping
	var reason, why string
	switch d.mode {
	case drainRelease:
		if mp = l.p.lookup(d.dev.name); !mp.Mapped() {
			if !rebuild {
				return false
			}
			reason, why = mp.Reason(), mp.Detail()
		}
	case drainExpire:
		if (l.park.cfg.MaxAge <= 0 || time.Since(e.at) <= l.park.cfg.MaxAge) && !rebuild {
			return false
		}
		reason = wire.ReasonParkExpired
	case drainForce:
		mp = l.p.lookup(d.dev.name)
		reason, why = mp.Reason(), mp.Detail()
	case drainDrop:
		reason = wire.ReasonParkDropped
	}
	if ref.level >= 1 {
		reason, why = ref.reason, ref.why
	}
	lay := l.p.cfg.Layout
	stored := hdr.Get(wire.HeaderSubject)
	var subject string
	if err := lay.Parse(stored, &l.fields); err != nil {
		reason, why = wire.ReasonMalformedSubject, err.Error()
		subject = lay.MalformedSubject()
	} else if reason == "" {
		subject = string(lay.AppendOut(l.buf[:0], &l.fields, mp.Values))
	} else {
		subject = string(lay.AppendUnmapped(l.buf[:0], &l.fields))
	}
	e.reason = reason
	data := e.src.Data()
	// The park's provenance named the owner that parked it (and, stored before KVMapper-Prov,
	// in the three headers it replaced): what is published now gets this lane's, or none.
	delete(hdr, wire.HeaderProvenance)
	delete(hdr, wire.HeaderPartition)
	delete(hdr, wire.HeaderEpoch)
	delete(hdr, wire.HeaderRevision)
	if reason == "" {
		delete(hdr, wire.HeaderSubject)
		for i := range lay.NumHeaders() {
			hdr[lay.HeaderName(i)] = []string{string(lay.AppendHeader(l.buf[:0], i, &l.fields, mp.Values))}
		}
		if !l.p.cfg.NoProvenance {
			hdr[wire.HeaderProvenance] = []string{l.provPrefix + strconv.FormatUint(mp.Revision, 10)}
		}
	} else {
		delete(hdr, wire.HeaderProvenance)
		hdr[wire.HeaderSubject] = []string{stored}
		l.deadHeaders(hdr, reason, why)
		if mp.Field() != "" && reason == mp.Reason() {
			hdr[wire.HeaderField] = []string{mp.Field()}
		}
		if reason == wire.ReasonOversized {
			data = nil // what did not fit; it stays in INCOMING under the sequence in its Nats-Msg-Id
		}
	}
	if ref.level == 2 {
		hdr = nats.Header{
			nats.MsgIdHdr:      hdr[nats.MsgIdHdr],
			wire.HeaderReason:  hdr[wire.HeaderReason],
			wire.HeaderSubject: []string{stored},
			wire.HeaderError:   hdr[wire.HeaderError],
		}
		data = nil
	}
	e.msg = nats.Msg{Subject: subject, Header: hdr, Data: data}
	e.om.Key, e.om.Out, e.om.Stream = e.seq, &e.msg, outOutgoing
	if reason != "" {
		e.om.Stream = outUnmapped
	}
	if !rebuild {
		e.cost = int64(e.msg.Size() + replyRoom)
	}
	return true
}

// drainAdmit hands d's held message to its writer if the window has room, the lease holds and
// the writer would send it now: while it sends one message at a time (the first of a drain, the
// first after a failure), what waits behind would only hold room of the lane's window, which the
// device's new parks need (TestParkThenReleaseInOrder).
func (l *lane) drainAdmit(d *drain) {
	e := d.held
	if e == nil || !l.valid() || d.w.Waiting() || !l.p.window.take(&l.grant, e.cost) {
		return
	}
	d.held = nil
	d.last = e.seq
	e.room = true
	d.q = append(d.q, e)
	d.w.Send(&e.om)
	d.w.Flush() // a drain hands one message at a time: what waits goes as the next batch
	if !d.w.Failed() {
		d.giveToken()
	}
}

// drainHooks are a drain's say in its writer's rounds of resends.
func (l *lane) drainHooks(d *drain) ordered.Hooks {
	return ordered.Hooks{
		Allow: func(*ordered.Msg) bool { return l.valid() },
		Redirect: func(m *ordered.Msg) bool {
			e := d.entryOf(m)
			if e == nil {
				return true
			}
			reason, why := permanent(m.Err)
			if reason == "" {
				return true
			}
			switch {
			case e.reason == "":
				e.ref = refusal{level: 1, reason: reason, why: why}
			case e.ref.level < 2:
				e.ref = refusal{level: 2, reason: e.reason, why: why}
			default:
				e.ref.level = 3
				l.p.dropped.Add(1)
				l.log.Error().Str("device", d.dev.name).Uint64("parked_seq", e.seq).Str("error", why).
					Msg("UNMAPPED refused even a stripped dead letter from the park; giving up on it (it stays in INCOMING): check UNMAPPED's limits")
				return false
			}
			l.fillDrained(d, e, true)
			return true
		},
	}
}

// entryOf returns d's entry of a message of its writer, or nil.
func (d *drain) entryOf(m *ordered.Msg) *drainEntry {
	for _, e := range d.q {
		if &e.om == m {
			return e
		}
	}
	return nil
}

// parkAnswered moves every drain on after answers were handled: what they stored leaves their
// queue, and a drain that is done finishes.
func (l *lane) parkAnswered() {
	if l.park == nil {
		return
	}
	for _, d := range l.park.drains {
		l.drainPop(d)
		l.drainAdmit(d)
		l.drainCheck(d)
	}
}

// drainPop removes d's stored prefix, moves through and gives the room back.
func (l *lane) drainPop(d *drain) {
	var n, bytes int64
	for m := d.w.Pop(); m != nil; m = d.w.Pop() {
		e := d.q[0]
		d.q[0] = nil
		d.q = d.q[1:]
		d.through, d.progress = e.seq, time.Now()
		if d.dev.count > 0 {
			d.dev.count--
			l.park.nMsgs.Add(-1)
		}
		if e.room {
			n++
			bytes += e.cost
		}
		switch {
		case m.Dropped:
		case m.Duplicate:
			l.p.duplicates.Add(1)
		case e.reason != "":
			l.p.countUnmapped(e.reason)
		default:
			l.p.mapped.Add(1)
			l.p.released.Add(1)
		}
	}
	l.p.window.give(&l.grant, n, bytes)
}

// drainRelease gives back the room d's publishes still hold and forgets them.
func (l *lane) drainRelease(d *drain) {
	var n, bytes int64
	for _, e := range d.q {
		if e.room {
			n++
			bytes += e.cost
		}
	}
	l.p.window.give(&l.grant, n, bytes)
	d.q, d.held = nil, nil
	d.w.Drop()
}

// drainsUnsettled tells whether some drain has a publish in flight.
func (l *lane) drainsUnsettled() bool {
	for _, d := range l.park.drains {
		if !d.w.Settled() {
			return true
		}
	}
	return false
}

// drainTick fails d's publishes that cannot be answered any more, resends after a failure once
// everything settled and a pause passed, and queues a purge of what it republished since the
// last one, so that a drain cut short resends little.
func (l *lane) drainTick(ctx context.Context, d *drain, now time.Time) {
	// Answers are handled wherever the lane reads its inbox (its writer waits on it too): take
	// in what they stored.
	l.drainPop(d)
	d.w.Expire(now)
	d.w.Flush()
	if d.w.Failed() && d.w.Settled() {
		switch {
		case d.retryAt.IsZero():
			first := d.w.FirstErr()
			d.retryAt = now.Add(d.w.Backoff(first))
			l.p.warn("park-publish", func(ev *zerolog.Event) {
				ev.Int("partition", l.a.Partition).Str("device", d.dev.name).Err(first).
					Msg("a drained message's publish failed; resending in order")
			})
			l.drainPause(d)
		case !now.Before(d.retryAt) && l.drainResume(d):
			d.retryAt = time.Time{}
			_ = d.w.Resend(l.drainHooks(d)) // a stop is the lane's to see (valid)
			// Read on from what the pause kept: the reader hands one message now, and drainAdmit
			// holds it until the writer would send it.
			l.startReader(ctx, d, d.last+1)
			l.drainPop(d)
			l.drainCheck(d)
		}
	}
	if d.started && !d.stopping && d.through < d.l0 && d.w.Len() == 0 && d.held == nil && now.Sub(d.progress) > drainIdle {
		// Waiting for a message that may be gone: read where the device stands again.
		d.started = false
		l.startReader(ctx, d, d.through+1)
	}
	if d.through > d.purgedTo && now.Sub(d.purgedAt) >= l.park.cfg.PurgeInterval {
		d.purgedTo, d.purgedAt = d.through, now
		l.queuePurge(d.dev.name, d.through)
	}
}

// drainPause makes d hold no room of the window while it waits to resend after a failure (as
// the lane's own publishes keep theirs): a drain whose stream does not answer must not starve the
// lane's parks of the device, which queue behind it (TestParkThenReleaseInOrder, whose lane's
// share of the window is one message). It keeps what its writer has up to the last message
// stored (those behind it need no resending) and at least the first not stored, and reads the
// rest from PARKED again once it resends.
func (l *lane) drainPause(d *drain) {
	keep := 1
	for i, e := range d.q {
		if e.om.Stored {
			keep = i + 1
		}
	}
	keep = min(keep, len(d.q))
	var n, bytes int64
	for _, e := range d.q {
		if e.room {
			e.room = false
			n++
			bytes += e.cost
		}
	}
	l.p.window.give(&l.grant, n, bytes)
	if keep < len(d.q) {
		clear(d.q[keep:])
		d.q = d.q[:keep]
		d.w.Keep(keep)
	}
	if len(d.q) > 0 {
		d.last = d.q[len(d.q)-1].seq
	}
	d.held = nil
	d.stopReader()
	d.stopping, d.stopAt = false, time.Time{} // the reader finds where to stop again
}

// drainResume takes room again for what d kept through its pause and has to resend; false when
// the window has none for it yet (the next tick tries again).
func (l *lane) drainResume(d *drain) bool {
	var n, bytes int64
	ok := true
	for _, e := range d.q {
		if e.room || e.om.Stored {
			continue
		}
		if !l.p.window.take(&l.grant, e.cost) {
			ok = false
			break
		}
		e.room = true
		n++
		bytes += e.cost
	}
	if !ok {
		for _, e := range d.q {
			if e.room {
				e.room = false
			}
		}
		l.p.window.give(&l.grant, n, bytes)
	}
	return ok
}

// drainCheck finishes d when it is done: everything PARKED held of the device has been
// republished and stored, and nothing of it is in flight to PARKED; or it stopped and nothing
// of it is in flight any more.
func (l *lane) drainCheck(d *drain) {
	if d.w.Len() > 0 || d.held != nil || d.w.Failed() {
		return
	}
	dev := d.dev
	switch {
	case d.stopping:
		l.finishDrain(d, false)
	case d.started && d.through >= d.l0 && d.through >= dev.last && dev.inFlight == 0:
		l.finishDrain(d, true)
	}
}

// finishDrain ends d; when done, the device leaves the parked devices, and its next message is
// mapped like any other's.
func (l *lane) finishDrain(d *drain, done bool) {
	s := l.park
	d.stopReader()
	d.w.Close()
	delete(s.drains, d.id)
	dev := d.dev
	dev.drain = nil
	if d.started {
		dev.last = max(dev.last, d.l0)
		dev.inherited = false
	}
	if d.through > d.purgedTo {
		l.queuePurge(dev.name, d.through)
	}
	if s.devices[dev.name] != dev {
		return
	}
	if done {
		l.log.Debug().Str("device", dev.name).Uint64("through", d.through).Msg("parked device drained")
		l.unparkDevice(dev)
		return
	}
	if !d.stopAt.IsZero() {
		dev.oldest = d.stopAt
	}
	if dev.unpark != 0 {
		l.queueDrain(dev, dev.unpark)
	}
}
