package lanes

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/wire"
)

// A drain reads one parked device's messages back from PARKED, in order, with an ordered
// consumer on the device's subject fed to the lane like its main reader, and republishes each:
// to OUTGOING with the device's group (a release), or to UNMAPPED with a reason (past the
// maximum age, or by hand). Its publishes take room in the pool's window like the lane's own,
// and keep their own queue, which never moves the checkpoint: the messages were checkpointed
// when PARKED stored them.
//
// After any failure a drain sends nothing new until every publish in flight has settled, then
// starts again from its acknowledged prefix, the first message alone: what OUTGOING had stored
// is dropped as a duplicate, so a drain keeps the device's order under the same rule as the lane.
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

	started bool   // the reader read where the device stood: l0 is known
	l0      uint64 // the device's last PARKED sequence then

	q        []*drainEntry // in flight, in PARKED order
	held     *drainEntry   // built, waiting for room in the window
	through  uint64        // every message of the device up to this PARKED sequence is done
	purgedTo uint64        // through, when a purge was last queued
	purgedAt time.Time     // when
	progress time.Time     // when through last moved, or the drain (re)started

	failed    bool      // some publish failed: send nothing more, restart once all settled
	probe     bool      // after an unanswered failure the first message goes alone
	restartAt time.Time // when to start reading again after a failure; zero when not waiting
	backoff   time.Duration
	refusals  map[uint64]refusal // PARKED sequence → how to send it after a refusal for good

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
	seq       uint64 // PARKED sequence
	msg       nats.Msg
	reason    string // non-empty for a dead letter
	stripped  bool
	skip      bool // given up (counted as dropped): not sent
	gen       uint64
	sent      time.Time
	cost      int64
	acked     bool
	duplicate bool
	err       error
}

func (e *drainEntry) settled() bool { return e.acked || e.err != nil }

// startDrain starts draining dev in mode.
func (l *lane) startDrain(ctx context.Context, dev *parkedDevice, mode drainMode) {
	s := l.park
	s.nextID++
	d := &drain{id: s.nextID, dev: dev, mode: mode, refusals: map[uint64]refusal{}, purgedAt: time.Now()}
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
	if seq <= d.through {
		d.giveToken()
		return
	}
	if d.failed || d.stopping || !d.restartAt.IsZero() {
		d.stopReader() // the restart reads it again
		return
	}
	e := l.buildDrained(d, m, seq, at)
	if e == nil {
		d.stopping, d.stopAt = true, at
		d.stopReader()
		l.drainCheck(d)
		return
	}
	d.held = e
	l.drainAdmit(d)
}

// buildDrained makes what to publish for parked message m, or returns nil when d stops before
// it: a release whose device has no group, or an expiry that reached a message young enough.
func (l *lane) buildDrained(d *drain, m jetstream.Msg, seq uint64, at time.Time) *drainEntry {
	e := &drainEntry{seq: seq}
	hdr := m.Headers()
	if hdr == nil {
		hdr = nats.Header{}
	}
	ref := d.refusals[seq]
	if ref.level >= 3 {
		e.skip, e.acked = true, true
		return e
	}
	var group, reason, why string
	var rev uint64
	switch d.mode {
	case drainRelease:
		if group, rev, reason = l.p.lookup(d.dev.name); reason != "" {
			return nil
		}
	case drainExpire:
		if l.park.cfg.MaxAge <= 0 || time.Since(at) <= l.park.cfg.MaxAge {
			return nil
		}
		reason = wire.ReasonParkExpired
	case drainForce:
		group, rev, reason = l.p.lookup(d.dev.name)
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
		subject = string(lay.AppendOut(l.buf[:0], &l.fields, group))
	} else {
		subject = string(lay.AppendUnmapped(l.buf[:0], &l.fields))
	}
	e.reason = reason
	data := m.Data()
	if reason == "" {
		delete(hdr, wire.HeaderSubject)
		if !l.p.cfg.NoProvenance {
			hdr[wire.HeaderPartition] = l.partHdr
			hdr[wire.HeaderEpoch] = l.epochHdr
			hdr[wire.HeaderRevision] = []string{strconv.FormatUint(rev, 10)}
		}
	} else {
		delete(hdr, wire.HeaderRevision)
		hdr[wire.HeaderSubject] = []string{stored}
		l.deadHeaders(hdr, reason, why)
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
		data, e.stripped = nil, true
	}
	e.msg = nats.Msg{Subject: subject, Header: hdr, Data: data}
	e.cost = int64(e.msg.Size() + len(l.park.inbox) + 2*maxUint64Digits + 1)
	return e
}

// drainAdmit publishes d's held message if the window has room, the lease holds and, after a
// failure, nothing else is in flight.
func (l *lane) drainAdmit(d *drain) {
	e := d.held
	if e == nil {
		return
	}
	if e.skip {
		d.held = nil
		d.q = append(d.q, e)
		l.drainPop(d)
		d.giveToken()
		l.drainCheck(d)
		return
	}
	if !l.valid() || (d.probe && len(d.q) > 0) || d.failed {
		return
	}
	if !l.p.window.take(&l.grant, e.cost) {
		return
	}
	gen := l.p.generation()
	if len(d.q) > 0 && d.q[0].gen != gen {
		// Sent on a connection since replaced: sending now could overtake what it lost.
		l.p.window.give(&l.grant, 1, e.cost)
		l.drainFail(d, nats.ErrDisconnected)
		return
	}
	d.held = nil
	e.gen, e.sent = gen, time.Now()
	e.msg.Reply = l.park.inbox + strconv.FormatUint(d.id, 10) + "." + strconv.FormatUint(e.seq, 10)
	d.q = append(d.q, e)
	if err := l.p.nc.PublishMsg(&e.msg); err != nil {
		e.err = err
		d.failed = true
		return
	}
	if l.p.generation() != gen {
		e.err = nats.ErrDisconnected
		d.failed = true
		return
	}
	if !d.probe {
		d.giveToken()
	}
}

// drainFail fails every unsettled publish of d.
func (l *lane) drainFail(d *drain, err error) {
	for _, e := range d.q {
		if !e.settled() {
			e.err = err
		}
	}
	d.failed = true
}

// drainAck applies an acknowledgement of a drain's publish.
func (l *lane) drainAck(m *nats.Msg) {
	s := l.park
	rest := strings.TrimPrefix(m.Subject, s.inbox)
	ids, seqs, ok := strings.Cut(rest, ".")
	id, err1 := strconv.ParseUint(ids, 10, 64)
	seq, err2 := strconv.ParseUint(seqs, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return
	}
	d := s.drains[id]
	if d == nil {
		return
	}
	var e *drainEntry
	i := 0
	for ; i < len(d.q); i++ {
		if d.q[i].seq == seq {
			e = d.q[i]
			break
		}
	}
	if e == nil || e.settled() {
		return
	}
	e.duplicate, _, e.err = parseAck(m)
	if e.err != nil {
		d.failed = true
	} else {
		e.acked = true
		if !e.duplicate {
			// The stream stores one connection's publishes in order: an earlier one still
			// unanswered was lost.
			for _, x := range d.q[:i] {
				if !x.settled() && x.gen == e.gen {
					x.err = errOvertaken
					d.failed = true
				}
			}
		}
		if d.probe && !d.failed {
			d.probe = false
			d.giveToken()
		}
	}
	l.drainPop(d)
	l.drainCheck(d)
}

// drainPop removes d's acknowledged prefix, moves through and gives the room back.
func (l *lane) drainPop(d *drain) {
	var n, bytes int64
	for len(d.q) > 0 && d.q[0].acked {
		e := d.q[0]
		d.q[0] = nil
		d.q = d.q[1:]
		d.through, d.progress = e.seq, time.Now()
		d.backoff = 0
		if d.dev.count > 0 {
			d.dev.count--
			l.park.nMsgs.Add(-1)
		}
		if e.skip {
			continue
		}
		n++
		bytes += e.cost
		switch {
		case e.duplicate:
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
		if !e.skip {
			n++
			bytes += e.cost
		}
	}
	l.p.window.give(&l.grant, n, bytes)
	d.q, d.held = nil, nil
}

// drainsUnsettled tells whether some drain has a publish in flight.
func (l *lane) drainsUnsettled() bool {
	for _, d := range l.park.drains {
		for _, e := range d.q {
			if !e.settled() {
				return true
			}
		}
	}
	return false
}

// drainTick fails d's publishes that cannot be answered any more, restarts d once a failure
// has settled, and queues a purge of what it republished since the last one, so that a drain
// cut short resends little.
func (l *lane) drainTick(ctx context.Context, d *drain, now time.Time) {
	gen := l.p.generation()
	for _, e := range d.q {
		switch {
		case e.settled():
		case e.gen != gen:
			e.err = nats.ErrDisconnected
			d.failed = true
		case now.Sub(e.sent) > l.p.cfg.PublishTimeout:
			e.err = errAckTimeout
			d.failed = true
		}
	}
	if d.failed && !l.drainUnsettled(d) {
		l.drainRestart(d, now)
	}
	switch {
	case !d.restartAt.IsZero():
		if !now.Before(d.restartAt) {
			d.restartAt = time.Time{}
			l.startReader(ctx, d, d.through+1)
		}
	case d.started && !d.stopping && d.through < d.l0 && len(d.q) == 0 && d.held == nil && now.Sub(d.progress) > drainIdle:
		// Waiting for a message that may be gone: read where the device stands again.
		d.started = false
		l.startReader(ctx, d, d.through+1)
	}
	if d.through > d.purgedTo && now.Sub(d.purgedAt) >= l.park.cfg.PurgeInterval {
		d.purgedTo, d.purgedAt = d.through, now
		l.queuePurge(d.dev.name, d.through)
	}
}

func (l *lane) drainUnsettled(d *drain) bool {
	for _, e := range d.q {
		if !e.settled() {
			return true
		}
	}
	return false
}

// drainRestart ends the round of d that failed: what was acknowledged is done, a message
// refused for good is sent another way next time, and reading starts again after a backoff from
// the first message not acknowledged, alone if the failure went unanswered.
func (l *lane) drainRestart(d *drain, now time.Time) {
	l.drainPop(d)
	var first *drainEntry
	for _, e := range d.q {
		if e.err != nil {
			first = e
			break
		}
	}
	probe := false
	if first != nil {
		probe = unanswered(first.err)
		reason, why := permanent(first.err)
		if reason != "" {
			ref := d.refusals[first.seq]
			switch {
			case first.reason == "":
				ref = refusal{level: 1, reason: reason, why: why}
			case !first.stripped:
				ref = refusal{level: 2, reason: first.reason, why: why}
			default:
				ref.level = 3
				l.p.dropped.Add(1)
				l.log.Error().Str("device", d.dev.name).Uint64("parked_seq", first.seq).Str("error", why).
					Msg("UNMAPPED refused even a stripped dead letter from the park; giving up on it (it stays in INCOMING): check UNMAPPED's limits")
			}
			d.refusals[first.seq] = ref
		}
		l.p.warn("park-publish", func(ev *zerolog.Event) {
			ev.Int("partition", l.a.Partition).Str("device", d.dev.name).Err(first.err).
				Msg("a drained message's publish failed; resending in order")
		})
	}
	l.p.failures.Add(1)
	l.drainRelease(d)
	d.stopReader()
	d.failed, d.stopping, d.stopAt = false, false, time.Time{}
	if d.backoff == 0 {
		d.backoff = l.p.cfg.RetryBackoff
	} else {
		d.backoff = min(2*d.backoff, l.p.cfg.MaxRetryBackoff)
	}
	if probe {
		d.backoff = min(d.backoff, maxProbeBackoff)
	}
	d.probe = probe
	d.restartAt = now.Add(d.backoff)
}

// drainCheck finishes d when it is done: everything PARKED held of the device has been
// republished and acknowledged, and nothing of it is in flight to PARKED; or it stopped and
// nothing of it is in flight any more.
func (l *lane) drainCheck(d *drain) {
	if len(d.q) > 0 || d.held != nil || d.failed || !d.restartAt.IsZero() {
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
