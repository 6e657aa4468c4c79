package lanes

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/ordered"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// entry is one INCOMING message on its way out, from publish to acknowledgement.
type entry struct {
	// om is what the lane's writer publishes and what it learns of it: Key is seq, Stream the
	// output stream (streamOf), Out the mapped message m or a dead letter.
	om       ordered.Msg
	seq      uint64        // INCOMING stream sequence
	src      jetstream.Msg // the consumed message, to rebuild a dead letter from
	m        nats.Msg      // the message itself, allocated with the entry
	hdr      nats.Header   // the entry's own header map, cleared and refilled for every message
	text     []byte        // the bytes of subject, Nats-Msg-Id and provenance (see [entry.since])
	id       [1]string     // backing of the Nats-Msg-Id header value
	prov     [1]string     // backing of the KVMapper-Prov header value of a mapped message
	hvals    []string      // backing of the output headers' values, one each (see [subjects.Layout.WithHeaders])
	reason   string        // non-empty when msg is a dead letter
	device   string        // the device, for the reorder check (a substring of the INCOMING subject)
	stripped bool          // a dead letter reduced to its reason after UNMAPPED refused it
	parked   bool          // built as a park (see park.go): to PARKED unless reason is set
	cost     int64         // bytes it holds of the pool's window: its size on the wire when admitted
}

// msg is what e publishes: the mapped message, or a dead letter.
func (e *entry) msg() *nats.Msg { return e.om.Out }

// acked tells whether e's stream stored it (or had it already), or the lane gave up on it.
func (e *entry) acked() bool { return e.om.Stored || e.om.Dropped }

// reset clears e for its next message, keeping the header map, the text buffer and the
// header values' backing it owns.
func (e *entry) reset() {
	hdr, text, hvals := e.hdr, e.text, e.hvals
	clear(hdr)
	clear(hvals)
	*e = entry{hdr: hdr, text: text[:0], hvals: hvals}
}

// since returns what was appended to e's text from offset from on, as a string that shares e's
// bytes: no allocation. That is safe because nothing writes those bytes again until e is reset,
// after it settled, when nothing refers to its strings any more: nats.go copies subject, reply
// and header values into its own buffer when it publishes, and e's message, dead letter and
// header map go with e. (An append that outgrows text moves on to a new array and leaves the old
// one, and the strings in it, untouched.)
func (e *entry) since(from int) string {
	if len(e.text) == from {
		return ""
	}
	return unsafe.String(&e.text[from], len(e.text)-from)
}

// laneStats are what a lane shows of itself to other goroutines.
type laneStats struct {
	acked, checkpoint, pending atomic.Uint64
	inFlight                   atomic.Int64
	next                       atomic.Uint64 // the sequence the reader hands on next
	w                          waitStats     // what the lane's watcher reads (wait.go)
}

// delivery is a consumed message with its stream sequence, handed from reader to lane.
type delivery struct {
	msg  jetstream.Msg
	seq  uint64
	size int64 // subject, reply, headers and payload: what it holds of the feed's bytes
}

// lane is the pipeline of one partition. Everything but the reader runs on one goroutine, which
// is what keeps order (STYLE rule 14): messages are published in stream order, acknowledgements
// are consumed in the same order, and after any failure nothing new is sent until every earlier
// message has been resent in order.
type lane struct {
	p   *Pool
	a   Assignment
	log zerolog.Logger
	key string // checkpoint.<p>

	stream       string    // the stream holding the partition: INCOMING, or INCOMING-<p>
	filter       string    // the partition's filter on stream; "" when the stream holds it alone
	inc          string    // incarnation of the stream the lane reads (see [wire.Incarnation])
	cpRev        uint64    // revision of our last checkpoint write: the fence
	checkpointed uint64    // sequence last written
	acked        uint64    // contiguous acknowledged prefix
	dirtySince   time.Time // when acked last moved past checkpointed
	unsure       []uint64  // checkpoints written since the last success whose outcome is unknown

	// The checkpoint write in flight, at most one (see [lane.startCheckpoint]): cpBusy says
	// there is one, cpDone (capacity 1) receives its outcome, cpWG waits for its goroutine.
	cpBusy bool
	cpDone chan cpResult
	cpWG   sync.WaitGroup

	q     []*entry // in flight, in stream order: the entries of w's queue, one for one
	held  *entry   // consumed and prepared, waiting for room in the pool's window
	grant grant    // what the lane holds of the pool's window
	ro    reorders // finds the messages this lane stored out of their device's order

	in *ordered.Inbox  // the answers of the lane's writers, read by the lane's goroutine
	w  *ordered.Writer // the lane's own writer: OUTGOING, UNMAPPED, PARKED

	free []*entry // settled entries, reused: most of a message's allocations are its entry
	// readErr carries the error that ended reading for good (INCOMING re-created); the reader
	// and watchIncarnation send at most one between them, and nobody closes it.
	readErr chan error

	feed feed // bounds the bytes the reader has handed on and the lane not yet taken

	park *parking // its parked devices (see park.go); nil when parking is off

	// deletes are the deletions of the consumers the reader is done with, in the background.
	deletes sync.WaitGroup

	// fences are the lane's fences in its output streams, by stream name, written before the
	// lane started publishing (see outfence.go); nil when none is fenced. fenceOrder holds them
	// in the order they were written; checked is what the lane vouches for ([Pool.Checked]).
	fences     map[string]OutputFence
	fenceOrder []OutputFence
	checked    string

	stats laneStats // read by Pool.Partitions from other goroutines

	// replace (capacity 1) tells the reader to replace a consumer that delivers nothing
	// (wait.go).
	replace chan struct{}

	clock leaseClock // the lease's clock, read once per burst of checks (see leaseclock.go)

	fields   subjects.Fields
	buf      []byte
	idPrefix string
	// provPrefix is "<partition>.<epoch>.", the start of a mapped message's KVMapper-Prov
	// (the revision follows); provDead is a dead letter's or a park's whole value.
	provPrefix string
	provDead   []string
}

func newLane(p *Pool, a Assignment) *lane {
	names := subjects.Names{Incoming: p.cfg.Incoming, StreamLayout: p.cfg.StreamLayout}
	stream, filter := names.IncomingStream(p.cfg.Layout, a.Partition)
	return &lane{
		p:          p,
		a:          a,
		stream:     stream,
		filter:     filter,
		log:        p.log.With().Int("partition", a.Partition).Uint64("epoch", a.Epoch).Logger(),
		key:        wire.CheckpointKey(a.Partition),
		buf:        make([]byte, 0, 256),
		clock:      leaseClock{valid: a.Valid},
		provPrefix: provPrefix(a),
		provDead:   []string{wire.ProvenanceValue(a.Partition, a.Epoch, 0)},
		park:       newParking(&p.cfg.Park),
	}
}

// provPrefix is "<partition>.<epoch>.", the start of a mapped message's KVMapper-Prov; the epoch
// is left empty when the assignment has none (wire.AppendProvenance).
func provPrefix(a Assignment) string {
	p := strconv.Itoa(a.Partition) + "."
	if a.Epoch != 0 {
		p += strconv.FormatUint(a.Epoch, 10)
	}
	return p + "."
}

// valid reads the lease clock. The lane's own goroutine asks l.clock instead, which reads it
// less often.
func (l *lane) valid() bool { return l.a.Valid == nil || l.a.Valid() }

func (l *lane) run(ctx context.Context) error {
	// The outputs first: once a stream holds this lane's record, an earlier owner can store
	// nothing more there, so the checkpoint it may still write covers only what it stored.
	if err := l.fenceOutputs(ctx); err != nil {
		if ctx.Err() != nil {
			return nil // released before it started
		}
		return err
	}
	start, err := l.fence(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil // released before it started
		}
		return err
	}
	l.acked, l.checkpointed = start, start
	l.cpDone = make(chan cpResult, 1)
	defer l.cpWG.Wait()
	l.ro.takeover = maxWindow
	l.grant.wake = make(chan struct{}, 1)
	l.feed.room = make(chan struct{}, 1)
	l.stats.acked.Store(start)
	l.stats.checkpoint.Store(start)
	l.stats.next.Store(start + 1)
	now := time.Now()
	l.stats.w.quietSince.Store(now)
	l.stats.w.gateSince.Store(now)
	l.replace = make(chan struct{}, 1)
	l.p.register(l)
	defer l.p.unregister(l)
	closeInbox, err := l.startWriter(ctx)
	if err != nil {
		return err
	}
	defer closeInbox()
	stopParking, err := l.startParking(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer stopParking()
	l.log.Debug().Uint64("from", start+1).Msg("lane started")

	l.readErr = make(chan error, 1)
	readCtx, stopReading := context.WithCancel(ctx)
	in := make(chan delivery, feedLen)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		l.read(readCtx, start+1, in)
	}()
	wg.Go(func() { l.watchIncarnation(readCtx) })
	wg.Go(func() { l.watchWaits(readCtx, l.replace) })
	defer func() {
		stopReading()
		wg.Wait()
		l.deletes.Wait()
	}()

	tick := time.NewTicker(l.p.cfg.CheckpointInterval)
	defer tick.Stop()
	for {
		l.popSettled()
		if !l.clock.holds() {
			stopReading()
			return l.stop(ErrFenced)
		}
		if err := l.w.Fenced(); err != nil {
			stopReading()
			return l.stop(ErrFenced)
		}
		if l.w.Failed() {
			if err := l.recover(ctx); err != nil {
				stopReading()
				if ctx.Err() != nil {
					// The caller ended the lane during the round: a lost lease (cause ErrFenced)
					// stops the round at once, which recover reports as fenced, but the caller
					// asked for it, and its cause decides the drain.
					return l.stopped(ctx)
				}
				return l.stop(err)
			}
			if ctx.Err() != nil {
				// Released (or shut down) while resending: stop drains what is left.
				stopReading()
				return l.stopped(ctx)
			}
			continue
		}
		if l.held != nil {
			if l.admit(l.held) {
				l.held = nil
			} else if l.w.Failed() || !l.clock.holds() {
				continue
			}
		}
		var inc <-chan delivery
		var wake <-chan struct{}
		switch {
		case l.held != nil:
			wake = l.grant.wake
			l.setGate(gateWindow)
		case l.acked > l.checkpointed && time.Since(l.dirtySince) > l.p.cfg.MaxCheckpointAge:
			// The prefix moved past the checkpoint too long ago: a takeover now would resend
			// more than OUTGOING's duplicate window still recognises. Take nothing new until a
			// write succeeds (the tick keeps trying).
			l.setGate(gateCheckpoint)
		default:
			inc = in
			l.setGate(gateNone)
		}
		if l.parkHeld() {
			wake = l.grant.wake
		}
		select {
		case <-ctx.Done():
			stopReading()
			return l.stopped(ctx)
		case d := <-inc:
			l.take(d, inc)
		case err := <-l.readErr:
			stopReading()
			return l.stop(err)
		case <-wake:
			l.parkStep(ctx)
		case ev := <-l.parkEvents():
			l.parkEvent(ctx, ev)
		case m := <-l.in.C():
			l.in.Handle(m)
			l.in.Drain(burst - 1)
			l.parkAnswered()
		case r := <-l.cpDone:
			if err := l.applyCheckpoint(r); err != nil {
				stopReading()
				return l.stop(err)
			}
		case now := <-tick.C:
			l.in.Drain(-1)
			l.w.Expire(now)
			l.w.Flush()
			l.startCheckpoint()
			l.parkTick(ctx, now)
		}
	}
}

// burst is how many deliveries, or acknowledgements, the lane handles in one round of its loop
// when they are there already: a round costs a select over every channel the lane waits on.
const burst = feedLen

// take publishes d and then, while there is room and nothing failed, the deliveries already
// waiting in in, up to burst in all. A delivery there is no room for is held. When nothing more
// is ready (in is empty, or no room is left) the writer commits what it batched: a batch never
// waits to fill.
func (l *lane) take(d delivery, in <-chan delivery) {
	defer func() {
		if len(in) == 0 || l.held != nil {
			l.w.Flush()
		}
	}()
	for n := 1; ; n++ {
		l.feed.taken(d.size)
		if e := l.prepare(d); !l.admit(e) {
			l.held = e
			return
		}
		if n == burst || l.w.Failed() {
			return
		}
		select {
		case d = <-in:
		default:
			return
		}
	}
}

// admit hands e to the writer if the pool's window has room for it, unless the lease's clock
// has run out. (The writer holds it back when the connection was replaced while earlier
// publishes were in flight: their answers are lost, and sending on the new connection first
// would reorder.)
func (l *lane) admit(e *entry) bool {
	if !l.clock.publish(e.cost) {
		return false // the loop stops the lane
	}
	if !l.p.window.take(&l.grant, e.cost) {
		return false
	}
	l.push(e)
	return true
}

// push hands e to the writer and appends it to the in-flight queue; it holds room in the
// pool's window.
func (l *lane) push(e *entry) {
	e.om.Key, e.om.Stream = e.seq, streamOf(e)
	l.q = append(l.q, e)
	if len(l.q) == 1 {
		l.noteHead()
	}
	l.w.Send(&e.om)
	l.stats.inFlight.Store(int64(len(l.q)))
}

// popSettled removes acknowledged entries from the head of the queue, advances the prefix and
// gives their room in the window back.
func (l *lane) popSettled() {
	var n, bytes int64
	for m := l.w.Pop(); m != nil; m = l.w.Pop() {
		e := l.q[0]
		l.q[0] = nil
		l.q = l.q[1:]
		if e.om.Duplicate {
			l.noteStored()
		}
		n++
		bytes += e.cost
		if l.acked == l.checkpointed {
			l.dirtySince = time.Now()
		}
		l.acked = e.seq
		l.stats.acked.Store(e.seq)
		l.stats.inFlight.Store(int64(len(l.q)))
		l.observe(e)
		if e.parked {
			l.parkSettled(e)
		}
		switch {
		case e.om.Duplicate:
			l.p.duplicates.Add(1)
		case e.reason == wire.ReasonDropped:
		case e.reason != "":
			l.p.countUnmapped(e.reason)
		case e.parked: // counted by parkSettled
		default:
			l.p.mapped.Add(1)
		}
		e.reset()
		l.free = append(l.free, e)
	}
	if n > 0 {
		l.noteHead()
	}
	l.p.window.give(&l.grant, n, bytes)
}

// newEntry returns a cleared entry, reused if one is free.
func (l *lane) newEntry() *entry {
	if n := len(l.free); n > 0 {
		e := l.free[n-1]
		l.free = l.free[:n-1]
		return e
	}
	return new(entry)
}

// stopped stops the lane because ctx ended. Its cause says why: [ErrFenced] (the lease is
// lost) stops it without resending anything; anything else (a release, a shutdown) drains it.
// Either way the caller asked for it, so it returns nil unless the drain itself failed.
func (l *lane) stopped(ctx context.Context) error {
	cause := context.Cause(ctx)
	if errors.Is(cause, ErrFenced) {
		l.stop(cause)
		return nil
	}
	return l.stop(nil)
}

// stop drains the lane: it waits (up to DrainTimeout) for the in-flight publishes, resending in
// order while the lease holds, then writes the final checkpoint. It returns why the lane stopped.
func (l *lane) stop(why error) error {
	ctx, cancel := context.WithTimeout(context.Background(), l.p.cfg.DrainTimeout)
	defer cancel()
	if why == nil {
		l.w.Flush()
	} else {
		// Fenced: nothing new may be stored, but what was sent may have been, and the final
		// checkpoint should cover it, or the next owner sends it again (a duplicate,
		// TestRecreatedControlBucketUnderARunningReplica). An open batch is ended to learn its
		// outcome; what was never sent is not stored.
		l.w.EndBatches()
		for !l.w.Settled() && ctx.Err() == nil && l.w.Fenced() == nil {
			if err := l.w.Wait(ctx); err != nil {
				break
			}
		}
	}
	for len(l.q) > 0 && ctx.Err() == nil {
		l.popSettled()
		if len(l.q) == 0 {
			break
		}
		if l.w.Failed() || l.w.Fenced() != nil {
			if why != nil || !l.clock.holds() || l.w.Fenced() != nil {
				break // fenced: send nothing more; the next owner resumes after the prefix
			}
			if err := l.recover(ctx); err != nil {
				why = err
				break
			}
			continue
		}
		if err := l.w.Wait(ctx); err != nil {
			break
		}
	}
	l.in.Drain(-1)
	l.popSettled()
	l.noteStored()
	var bytes int64
	for _, e := range l.q {
		if e.acked() {
			// Stored, but behind a message that is not: the next owner resends it as a
			// duplicate, but only this lane can tell whether it stored it out of order.
			l.observe(e)
		}
		bytes += e.cost
	}
	l.p.window.give(&l.grant, int64(len(l.q)), bytes)
	l.stopParking(ctx, why)
	left := len(l.q)
	l.q, l.held = nil, nil
	l.w.Drop()
	l.stats.inFlight.Store(0)
	// Written even when the prefix did not move: a checkpoint key that vanished with a re-created
	// control bucket is restored from this lane's position (see restore).
	if err := l.finalCheckpoint(); err != nil && why == nil {
		why = err
	}
	ev := l.log.Debug()
	if left > 0 || (why != nil && !errors.Is(why, ErrFenced)) {
		ev = l.log.Warn()
	}
	ev.Uint64("checkpoint", l.checkpointed).Int("unacknowledged", left).AnErr("why", why).Msg("lane stopped")
	return why
}

// prepare builds what to publish for one consumed message: the hot path.
func (l *lane) prepare(d delivery) *entry {
	e := l.newEntry()
	l.build(e, d)
	// Its size on the wire, reply subject included, is what it holds of the pool's window.
	e.cost = int64(e.msg().Size() + replyRoom)
	return e
}

// build makes e what to publish for d: the mapped message, or a dead letter with its reason.
// The strings it publishes live in e's own buffer, and the header map is e's own: a message
// costs no allocation here (see [entry.since]).
func (l *lane) build(e *entry, d delivery) {
	e.seq, e.src, e.om.Out = d.seq, d.msg, &e.m
	lay := l.p.cfg.Layout
	hdr := l.headers(e)
	e.m.Header, e.m.Data = hdr, d.msg.Data()
	if err := lay.Parse(d.msg.Subject(), &l.fields); err != nil {
		hdr[wire.HeaderSubject] = []string{d.msg.Subject()}
		e.reason = wire.ReasonMalformedSubject
		e.m.Subject = lay.MalformedSubject()
		l.deadHeaders(hdr, e.reason, err.Error())
		return
	}
	e.device = l.fields.Device()
	m := l.p.lookup(e.device)
	if l.park != nil && l.park.parks(e.device, m.Reason()) {
		l.parkEntry(e, d, hdr)
		return
	}
	if !m.Mapped() {
		e.reason = m.Reason()
		from := len(e.text)
		e.text = lay.AppendUnmapped(e.text, &l.fields)
		e.m.Subject = e.since(from)
		l.deadHeaders(hdr, e.reason, m.Detail())
		if f := m.Field(); f != "" {
			hdr[wire.HeaderField] = []string{f}
		}
		return
	}
	from := len(e.text)
	e.text = lay.AppendOut(e.text, &l.fields, m.Values)
	e.m.Subject = e.since(from)
	if n := lay.NumHeaders(); n > 0 {
		if len(e.hvals) < n {
			e.hvals = make([]string, n)
		}
		for i := range n {
			v, ok := lay.HeaderString(i, m.Values)
			if !ok {
				from = len(e.text)
				e.text = lay.AppendHeader(e.text, i, &l.fields, m.Values)
				v = e.since(from)
			}
			e.hvals[i] = v
			hdr[lay.HeaderName(i)] = e.hvals[i : i+1 : i+1]
		}
	}
	if !l.p.cfg.NoProvenance {
		from = len(e.text)
		e.text = strconv.AppendUint(append(e.text, l.provPrefix...), m.Revision, 10)
		e.prov[0] = e.since(from)
		hdr[wire.HeaderProvenance] = e.prov[:]
	}
}

const expectedPrefix = "Nats-Expected-"

// headers fills e's header map with the consumed message's headers, made fit for OUTGOING: the
// Nats-Expected-* headers addressed INCOMING and are left out, as is every header that would make
// an output stream act on other messages ([wire.ActsOnStream]: a device's Nats-Rollup), a
// device's own Nats-Msg-Id is kept under [wire.HeaderOrigMsgID], and Nats-Msg-Id becomes
// "<INCOMING>:<sequence>", the same on every owner and every retry, so OUTGOING drops anything
// sent twice. A header named as one of the layout's output headers, in any case, or as one of
// kvmapper's provenance headers ([wire.IsProvenance]) is left out: kvmapper sets them, and a
// device cannot pass one off. The consumed message's own map is left as it is; its values are shared, never
// changed.
func (l *lane) headers(e *entry) nats.Header {
	hdr := e.hdr
	if hdr == nil {
		hdr = make(nats.Header, 8)
		e.hdr = hdr
	}
	lay := l.p.cfg.Layout
	for k, v := range e.src.Headers() {
		if len(k) >= len(expectedPrefix) && strings.EqualFold(k[:len(expectedPrefix)], expectedPrefix) {
			continue
		}
		if lay.NumHeaders() > 0 && lay.IsHeader(k) || wire.ActsOnStream(k) || wire.IsProvenance(k) {
			continue
		}
		hdr[k] = v
	}
	if id, ok := hdr[nats.MsgIdHdr]; ok {
		hdr[wire.HeaderOrigMsgID] = id
	}
	from := len(e.text)
	e.text = wire.AppendMsgID(e.text, l.idPrefix, e.seq)
	e.id[0] = e.since(from)
	hdr[nats.MsgIdHdr] = e.id[:]
	return hdr
}

func (l *lane) deadHeaders(hdr nats.Header, reason, why string) nats.Header {
	hdr[wire.HeaderReason] = []string{reason}
	if why != "" {
		hdr[wire.HeaderError] = []string{why}
	}
	if !l.p.cfg.NoProvenance {
		hdr[wire.HeaderProvenance] = l.provDead
	}
	return hdr
}

// redirect turns e into a dead letter to UNMAPPED after OUTGOING refused it for good.
func (l *lane) redirect(e *entry, reason, why string) {
	lay := l.p.cfg.Layout
	hdr := e.msg().Header
	subject := lay.MalformedSubject()
	if err := lay.Parse(e.src.Subject(), &l.fields); err == nil {
		subject = string(lay.AppendUnmapped(l.buf[:0], &l.fields))
	}
	hdr[wire.HeaderSubject] = []string{e.src.Subject()}
	e.reason = reason
	e.om.Out = &nats.Msg{Subject: subject, Header: l.deadHeaders(hdr, reason, why), Data: e.msg().Data}
	e.om.Stream = outUnmapped
	if reason == wire.ReasonOversized {
		// The payload itself is what did not fit; it stays in INCOMING under the sequence in
		// Nats-Msg-Id, which the dead letter names.
		e.om.Out.Data = nil
	}
}

// permanent tells whether a publish error is about the message itself, which resending cannot
// fix, and which dead-letter reason it gets.
func permanent(err error) (reason, why string) {
	if err == nil {
		return "", ""
	}
	if errors.Is(err, nats.ErrMaxPayload) {
		return wire.ReasonOversized, err.Error()
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch {
		case apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum || apiErr.ErrorCode == errCodeHeaderExceedsMaximum:
			return wire.ReasonOversized, apiErr.Description
		case apiErr.Code == 400 || apiErr.ErrorCode == errCodeRollupFailed:
			// A bad request is about the message (a per-message TTL the stream does not allow,
			// a counter increment, a schedule...): the same bytes would be refused again. So is
			// a rollup the stream does not allow or cannot apply, which the server answers 500.
			return wire.ReasonRejected, apiErr.Description
		}
	}
	return "", ""
}

// Error codes of nats-server's refusals of a message that nats.go has no constants for:
// JSStreamHeaderExceedsMaximumErr (400), and JSStreamRollupFailedF, which the server answers
// with code 500 although every cause of it is the message's Nats-Rollup header (not allowed on
// the stream, an invalid value, a rollup a batch cannot take: nats-server 2.15 stream.go and
// jetstream_batching.go). The server's other 500s and 503s are about the stream or the cluster
// and may pass; 429 is a full ingest queue.
const (
	errCodeHeaderExceedsMaximum jetstream.ErrorCode = 10097
	errCodeRollupFailed         jetstream.ErrorCode = 10111
)
