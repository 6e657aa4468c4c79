package direct

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// errReleased ends a lane's serving when its context ends without a fence: it hands over.
var errReleased = errors.New("direct: partition released")

// validEvery is how many messages a lane forwards between two readings of its lease clock, at
// most (Config.LeaseCheck bounds the time between them too).
const validEvery = 64

// lane is one partition of a [Pool]. Everything but the subscription callbacks runs on one
// goroutine (STYLE rule 14): messages are taken from the queue in the order the server delivered
// them and forwarded one after the other, which is what keeps each device's order.
type lane struct {
	p   *Pool
	a   Assignment
	log zerolog.Logger

	q     *queue
	spare []*nats.Msg // the queue's other slice (see queue.take)

	dataSubject   string             // what the lane receives: the partition, or every device subject
	markerSubject string             // where its handoff marker goes, as it arrives
	data          *nats.Subscription // ReceiveMapping: the partition's subscription
	routed        bool               // ReceiveAll: dispatch feeds it, or will from its start marker on
	// activated is closed, by dispatch, once the lane's start marker has arrived and it is fed
	// (wire.ReceiveAll).
	activated    chan struct{}
	activateOnce sync.Once
	handoff      *nats.Subscription // announcements of newer owners, once it serves
	// announces carries those announcements from handoff's callback, which drops what does not
	// fit; nobody closes it.
	announces chan *nats.Msg

	detachOnce sync.Once
	detached   chan struct{} // closed when Run may return: the lane ended, or it is handing over
	err        error         // what Run returns; set before detached is closed
	live       atomic.Bool   // serving under its lease (not joining, not handing over)

	// skip holds the reply subjects the previous owner forwarded during the handoff: the lane
	// drops them when they reach it, until skipUntil.
	skip      map[string]struct{}
	skipUntil time.Time
	// recent holds, with wire.ReceiveAll, the reply subjects the lane forwarded in the last
	// HandoffSettle while it served (from recentHead on): the replica's subscription delivers to
	// the next owner's pool on its own schedule, which may lag this one's, so the next owner may
	// hold a message this lane forwarded just before it was released. now is when the batch being
	// processed was taken.
	recent     []recentReply
	recentHead int
	now        time.Time
	// recording is set once the lane is released: it remembers in recorded the reply subject of
	// every message it forwards, for its next owner.
	recording  bool
	recorded   []string
	marker     string // the value of this lane's handoff marker, once published
	markerSeen bool   // the marker came back: what was delivered before the announcement is forwarded
	cut        bool   // recorded is full: the lane forwards nothing more

	fields  subjects.Fields
	buf     []byte
	out     nats.Msg
	rev     uint64
	provHdr []string // the KVMapper-Prov value for rev
}

func newLane(p *Pool, a Assignment) *lane {
	data, marker := p.subjectsFor(a.Partition)
	return &lane{
		p:             p,
		a:             a,
		log:           p.log.With().Int("partition", a.Partition).Uint64("epoch", a.Epoch).Logger(),
		q:             newQueue(p.cfg.QueueMessages, p.cfg.QueueBytes),
		dataSubject:   data,
		markerSubject: marker,
		announces:     make(chan *nats.Msg, 8),
		activated:     make(chan struct{}),
		detached:      make(chan struct{}),
		buf:           make([]byte, 0, 256),
	}
}

// detach lets Run return err; later calls do nothing.
func (l *lane) detach(err error) {
	l.detachOnce.Do(func() {
		l.err = err
		close(l.detached)
	})
}

func (l *lane) valid() bool { return l.a.Valid == nil || l.a.Valid() }

// run is the lane's goroutine: join, serve, and hand over when released.
func (l *lane) run(ctx context.Context) {
	defer l.detach(nil)
	defer l.unsubscribe()
	jctx, endJoin := l.joinContext(ctx)
	err := l.join(jctx)
	ended := jctx.Err() != nil // read before endJoin, which ends jctx
	endJoin()
	if err != nil {
		if ended {
			err = nil // fenced before it served, or released and the join did not end in time
		}
		l.stop(err)
		return
	}
	l.live.Store(true)
	err = l.serve(ctx)
	l.live.Store(false)
	if !errors.Is(err, errReleased) {
		l.stop(err)
		return
	}
	l.p.lingering.Add(1)
	defer l.p.lingering.Add(-1)
	l.detach(nil)
	l.linger()
}

// joinContext returns the context a lane joins under: ctx, except that a release (an end of ctx
// whose cause is not ErrFenced) ends it only HandoffTimeout later. A lane released while it joins
// has subscribed and announced itself: its previous owner hands over to it and stops forwarding,
// and what arrives meanwhile waits in its queue. Stopping then would leave those messages, and
// every one until the next owner subscribes, with no forward and no PubAck; so the lane finishes
// joining, serves, and hands over to its next owner as a released lane does (the lease is held
// until Run returns). end releases the context's resources.
func (l *lane) joinContext(ctx context.Context) (jctx context.Context, end func()) {
	jctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	var mu sync.Mutex
	var late *time.Timer
	ended := false
	stop := context.AfterFunc(ctx, func() {
		cause := context.Cause(ctx)
		if errors.Is(cause, ErrFenced) {
			cancel(cause)
			return
		}
		mu.Lock()
		if !ended {
			late = time.AfterFunc(l.p.cfg.HandoffTimeout, func() { cancel(cause) })
		}
		mu.Unlock()
	})
	return jctx, func() {
		stop()
		mu.Lock()
		ended = true
		if late != nil {
			late.Stop()
		}
		mu.Unlock()
		cancel(nil)
	}
}

// stop ends the lane without a handoff: Run returns err once the server has dropped the lane's
// subscriptions, so that what is published from then on is not left in a queue nobody takes.
func (l *lane) stop(err error) {
	l.unsubscribe()
	if ferr := l.p.nc.FlushTimeout(time.Second); ferr != nil {
		l.log.Debug().Err(ferr).Msg("flushing the unsubscribe")
	}
	l.detach(err)
}

// push is the subscription's callback (or dispatch's): it queues m for the lane's goroutine.
func (l *lane) push(m *nats.Msg) {
	if l.q.push(m) {
		return
	}
	l.p.dropped.Add(1)
	l.p.warn("queue full", func(e *zerolog.Event) {
		e.Int("partition", l.a.Partition).Int("queue_messages", l.p.cfg.QueueMessages).
			Msg("partition queue full: message dropped; its publisher gets no acknowledgement and must retry")
	})
}

// activate says that dispatch feeds the lane (wire.ReceiveAll); later calls do nothing.
func (l *lane) activate() { l.activateOnce.Do(func() { close(l.activated) }) }

// subscribe starts receiving the partition and makes sure the server has the subscription. With
// wire.ReceiveAll the replica's subscription predates the lane, and what it delivers can lag: a message
// the server sent before the previous owner released the partition may still be on its way. So the
// lane is fed only from a start marker on, which it publishes on that subscription now: whatever
// comes after the marker was sent after this moment.
func (l *lane) subscribe() error {
	if l.p.cfg.Receive == wire.ReceiveAll {
		if err := l.p.subscribeShared(); err != nil {
			return err
		}
		start := l.p.nonce(l.a)
		l.p.route(l, false, start)
		l.routed = true
		mk := nats.NewMsg(l.p.markerSubject)
		mk.Header.Set(HeaderMarker, start)
		if err := l.p.nc.PublishMsg(mk); err != nil {
			return errors.Join(errors.New("direct: publishing the start marker"), err)
		}
		t := time.NewTimer(l.p.cfg.AnswerTimeout)
		defer t.Stop()
		select {
		case <-l.activated:
			return nil
		case <-t.C:
			return errors.New("direct: the start marker did not come back within the answer timeout")
		}
	}
	sub, err := l.p.nc.Subscribe(l.dataSubject, l.push)
	if err == nil {
		l.data = sub
		// push never blocks: the bound that matters is the queue's.
		err = sub.SetPendingLimits(-1, -1)
	}
	if err == nil {
		err = l.p.nc.Flush()
	}
	if err != nil {
		return errors.Join(errors.New("direct: subscribing to "+l.dataSubject), err)
	}
	return nil
}

// unsubscribeData stops receiving the partition. Messages already queued stay queued.
func (l *lane) unsubscribeData() {
	if l.data != nil {
		_ = l.data.Unsubscribe()
		l.data = nil
	}
	if l.routed {
		l.p.route(l, false, "")
		l.routed = false
	}
}

// unsubscribe stops everything the lane receives.
func (l *lane) unsubscribe() {
	l.unsubscribeData()
	if l.handoff != nil {
		_ = l.handoff.Unsubscribe()
		l.handoff = nil
	}
}

// serve forwards the partition under its lease until ctx ends (errReleased, or nil when the
// cause is a fence), the lease clock runs out or a newer owner announces itself (ErrFenced).
func (l *lane) serve(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), ErrFenced) {
				return nil
			}
			return errReleased
		case <-l.q.ready:
			if !l.process(true) {
				l.log.Warn().Msg("lease clock ran out: partition stops forwarding")
				return ErrFenced
			}
		case m := <-l.announces:
			if l.newer(m) {
				// Only a lease lost without this replica noticing lets a newer owner claim: stop
				// now. What this lane forwarded was not recorded: the new owner forwards
				// everything it holds, and OUTGOING drops what carries a Msg-Id it has.
				l.unsubscribeData()
				l.answer(m, true)
				l.log.Warn().Str("new_owner", m.Header.Get(hdrReplica)).
					Msg("a newer owner announced itself while this replica held the lease: partition fenced")
				return ErrFenced
			}
		}
	}
}

// process forwards one batch of the queue. With checkLease it reads the lease clock every
// validEvery messages, and before any message sent more than LeaseCheck after the last reading,
// and, once it has run out, drops the rest of the batch (their publishers
// get no acknowledgement and retry) and reports false.
func (l *lane) process(checkLease bool) bool {
	batch := l.q.take(l.spare)
	l.now = time.Now()
	defer func() {
		clear(batch)
		l.spare = batch
	}()
	if l.skip != nil && time.Now().After(l.skipUntil) {
		l.skip = nil
	}
	var checked time.Time
	for i, m := range batch {
		if l.cut {
			return true // recorded is full: the next owner forwards everything from here on
		}
		if checkLease {
			// By count, and by time: the clock read costs nanoseconds, the lease clock more.
			if now := time.Now(); i%validEvery == 0 || now.Sub(checked) > l.p.cfg.LeaseCheck {
				if !l.valid() {
					return false
				}
				checked = now
			}
		}
		l.handle(m)
	}
	return true
}

// handle maps and forwards one message.
func (l *lane) handle(m *nats.Msg) {
	if v := m.Header.Get(HeaderMarker); v != "" && m.Subject == l.markerSubject {
		if v == l.marker {
			l.markerSeen = true
		}
		return // a marker: ours says the handoff may end; another lane's is not ours to forward
	}
	if l.skip != nil && m.Reply != "" {
		if _, ok := l.skip[m.Reply]; ok {
			delete(l.skip, m.Reply)
			if len(l.skip) == 0 {
				l.skip = nil
			}
			l.p.handedOver.Add(1)
			return
		}
	}
	lay := l.p.cfg.Layout
	if err := lay.Parse(m.Subject, &l.fields); err != nil {
		l.p.warn("malformed subject", func(e *zerolog.Event) {
			e.Str("subject", m.Subject).Err(err).Msg("malformed subject: message goes to UNMAPPED")
		})
		l.forward(m, lay.MalformedSubject(), subjects.Unmappable(wire.ReasonMalformedSubject, "", "", 0))
		return
	}
	dev := l.fields.Device()
	if strings.HasPrefix(dev, wire.ProbeDevicePrefix) && m.Header.Get(wire.HeaderProbe) != "" {
		return // kvmapper setup checking where device subjects arrive
	}
	mp := l.p.lookup(dev)
	if !mp.Mapped() {
		l.buf = lay.AppendUnmapped(l.buf[:0], &l.fields)
		l.forward(m, string(l.buf), mp)
		return
	}
	l.buf = lay.AppendOut(l.buf[:0], &l.fields, mp.Values)
	l.forward(m, string(l.buf), mp)
}

// forward publishes m to subject with its reply subject, payload and headers, adding the output
// headers of a mapped message (replacing the device's own of the same names), the reason of a
// dead letter, and the provenance headers.
func (l *lane) forward(m *nats.Msg, subject string, mp subjects.Mapping) {
	rev, reason := mp.Revision, mp.Reason()
	h := m.Header
	lay := l.p.cfg.Layout
	if h == nil && (reason != "" || l.p.cfg.Provenance || lay.NumHeaders() > 0) {
		h = nats.Header{}
	}
	for k := range h {
		// A device's Nats-Rollup would act on OUTGOING, which allows rollups for its fence
		// records (wire.ActsOnStream), and no device may pass provenance off; its other
		// headers are its own to send.
		if lay.NumHeaders() > 0 && lay.IsHeader(k) || wire.ActsOnStream(k) || wire.IsProvenance(k) {
			delete(h, k)
		}
	}
	if reason != "" {
		h[wire.HeaderReason] = []string{reason}
		h[wire.HeaderSubject] = []string{m.Subject}
		if d := mp.Detail(); d != "" {
			h[wire.HeaderError] = []string{d}
		}
		if f := mp.Field(); f != "" {
			h[wire.HeaderField] = []string{f}
		}
	} else {
		for i := range lay.NumHeaders() {
			h[lay.HeaderName(i)] = []string{string(lay.AppendHeader(l.buf[:0], i, &l.fields, mp.Values))}
		}
	}
	if l.p.cfg.Provenance {
		h[wire.HeaderProvenance] = l.provenance(rev)
	}
	l.out = nats.Msg{Subject: subject, Reply: m.Reply, Header: h, Data: m.Data}
	err := l.p.nc.PublishMsg(&l.out)
	if errors.Is(err, nats.ErrMaxPayload) && l.p.cfg.Provenance {
		// The device's message fitted; ours is larger by the provenance header alone.
		delete(h, wire.HeaderProvenance)
		err = l.p.nc.PublishMsg(&l.out)
	}
	if err != nil {
		l.p.failures.Add(1)
		l.p.dropped.Add(1)
		l.p.warn("publish failed", func(e *zerolog.Event) {
			e.Err(err).Str("subject", subject).Msg("forwarding failed: its publisher gets no acknowledgement and must retry")
		})
		return
	}
	if reason == "" {
		l.p.mapped.Add(1)
	} else {
		l.p.countUnmapped(reason)
	}
	if l.p.cfg.Receive == wire.ReceiveAll && !l.recording && m.Reply != "" {
		l.remember(m.Reply)
	}
	if l.recording && m.Reply != "" {
		l.recorded = append(l.recorded, m.Reply)
		if len(l.recorded) >= l.p.cfg.MaxRecorded {
			l.cut = true
		}
	}
}

// provenance returns the KVMapper-Prov header value for rev, reusing the last one.
func (l *lane) provenance(rev uint64) []string {
	if l.provHdr == nil || rev != l.rev {
		l.rev, l.provHdr = rev, []string{wire.ProvenanceValue(l.a.Partition, l.a.Epoch, rev)}
	}
	return l.provHdr
}

// recentReply is one reply subject a serving lane forwarded, and when.
type recentReply struct {
	at    time.Time
	reply string
}

// remember adds reply to recent and forgets what is older than HandoffSettle.
func (l *lane) remember(reply string) {
	l.recent = append(l.recent, recentReply{at: l.now, reply: reply})
	cutoff := l.now.Add(-l.p.cfg.HandoffSettle)
	for l.recentHead < len(l.recent) && l.recent[l.recentHead].at.Before(cutoff) {
		l.recent[l.recentHead] = recentReply{}
		l.recentHead++
	}
	if l.recentHead > len(l.recent)/2 && l.recentHead > 64 {
		n := copy(l.recent, l.recent[l.recentHead:])
		clear(l.recent[n:])
		l.recent, l.recentHead = l.recent[:n], 0
	}
}
