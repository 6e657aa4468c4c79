package ordered

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Mode says how a stream is written.
type Mode uint8

const (
	// ModeSingle publishes each message on its own, pipelined: each has its acknowledgement.
	ModeSingle Mode = iota + 1
	// ModeBatch publishes in fast-ingest batches with gap: fail; the stream needs allow_batched.
	// For one-replica streams: a fast batch cannot carry a fence on a replicated one.
	ModeBatch
	// ModeAtomic publishes in atomic batches, each stored whole or not at all, the first
	// message carrying the stream's fence ([Writer.SetFence]); the stream needs allow_atomic.
	// For replicated streams.
	ModeAtomic
)

// String returns "single" or "batch".
func (m Mode) String() string {
	switch m {
	case ModeSingle:
		return "single"
	case ModeBatch:
		return "batch"
	case ModeAtomic:
		return "atomic"
	}
	return "mode(" + strconv.Itoa(int(m)) + ")"
}

// ModeFor returns how kvmapper writes a stream configured so: in atomic batches when it is
// replicated and allows them (they can carry a fence, and a leader change cannot reorder them), in
// fast-ingest batches when it allows those (the fastest durable writes on one replica), with
// single publishes otherwise.
func ModeFor(c jetstream.StreamConfig) Mode {
	switch {
	case c.Replicas > 1 && c.AllowAtomicPublish:
		return ModeAtomic
	case c.AllowBatchPublish:
		return ModeBatch
	case c.AllowAtomicPublish:
		return ModeAtomic
	}
	return ModeSingle
}

// Stream is one stream a [Writer] writes, and how.
type Stream struct {
	Name string
	Mode Mode
	// Slots, when set, bounds the atomic batches open on the stream at once, across every
	// writer that shares it: the server refuses more than 50 per stream by default.
	Slots *Slots
}

// maxAtomic is the most messages of an atomic batch (nats-server's max_batch_size default).
const maxAtomic = 1000

// Config tunes a [Writer]. Zero fields mean the defaults given.
type Config struct {
	// PublishTimeout is how long a message may wait for its stream's answer before it is taken
	// for lost. Rounds of timeouts in a row double it, up to 4×. Default 5s.
	PublishTimeout time.Duration
	// StallTimeout is how long the writer waits with messages in flight and no answer at all
	// from the server before it takes them all for lost: a stream whose leader died answers
	// nothing until it has a new one, and then stores whatever comes next. Default 2s; negative
	// turns it off.
	StallTimeout time.Duration
	// RetryBackoff is the first pause before a round of resends; it doubles up to
	// MaxRetryBackoff. Defaults 50ms and 2s. A round after an unanswered failure (the stream may
	// be electing a leader) waits at most 500ms.
	RetryBackoff, MaxRetryBackoff time.Duration
	// OnFallback, when set, is called once for each stream that refused a batch because it does
	// not allow them (or a server that does not know them): the writer writes it singly from
	// then on.
	OnFallback func(stream string, err error)
	// Elected, when set, says when the latest leader of a stream was announced (the server's
	// leader advisories), zero when unknown. A leader that steps down drops the publishes it had
	// queued, and their answers never come: what was sent before the announcement and is still
	// unanswered LeaderGrace after it is taken for lost at once, not after StallTimeout.
	Elected func(stream string) time.Time
	// LeaderGrace is that moment. Default 100ms.
	LeaderGrace time.Duration
	// OnFail, when set, is called each time the writer turns failed: a message failed, or a
	// batch broke, and nothing new is sent until a round of resends.
	OnFail func()
	// CheckStream fails a message stored by another stream than its own with ErrWrongStream:
	// two streams whose subjects overlap.
	CheckStream bool
}

func (c *Config) setDefaults() {
	c.PublishTimeout = cmp.Or(c.PublishTimeout, 5*time.Second)
	c.StallTimeout = cmp.Or(c.StallTimeout, 2*time.Second)
	c.RetryBackoff = cmp.Or(c.RetryBackoff, 50*time.Millisecond)
	c.MaxRetryBackoff = cmp.Or(c.MaxRetryBackoff, 2*time.Second)
	c.LeaderGrace = cmp.Or(c.LeaderGrace, 100*time.Millisecond)
}

var (
	// ErrFenced is returned by [Writer.Recover] and [Writer.Resend] once a stream refused a
	// batch because its fence moved ([Writer.SetFence]): a newer owner wrote its record.
	// Nothing was stored of that batch, and the writer sends nothing more.
	ErrFenced = errors.New("ordered: fenced: a newer owner wrote the stream's fence record")
	// ErrWrongStream marks a message that another stream than the one it was sent for stored
	// ([Config].CheckStream).
	ErrWrongStream = errors.New("ordered: another stream stored the message")
	// ErrStopped is returned by [Writer.Resend] and [Writer.Recover] when [Hooks].Allow said
	// no: nothing more was sent.
	ErrStopped = errors.New("ordered: stopped by the caller")

	errAckTimeout    = errors.New("ordered: no acknowledgement within the publish timeout")
	errNoStream      = errors.New("ordered: no stream took the message: the stream does not exist (run kvmapper setup) or, on a cluster, is electing its leader")
	errBadAck        = errors.New("ordered: unreadable acknowledgement")
	errStalled       = errors.New("ordered: no answer from the server within the stall timeout (the stream may have no leader)")
	errOvertaken     = errors.New("ordered: a later publish was stored first: this one was lost (the stream changed leader)")
	errBatchEnded    = errors.New("ordered: the batch ended before this message was stored")
	errUnknown       = errors.New("ordered: the batch's outcome was lost: this message may or may not be stored")
	errFallback      = errors.New("ordered: the stream does not take batches: sent again singly")
	errLeaderChanged = errors.New("ordered: the stream changed leader; what was sent before and is unanswered is sent again in order")
	errConnChanged   = errors.New("ordered: the connection was replaced while this message was in flight")
	errNotConnected  = errors.New("ordered: not sent: the connection is reconnecting")
)

// Msg is one message on its way out. The caller fills Key, Stream and Out and hands it to
// [Writer.Send]; the writer fills in the outcome. The caller must not change a Msg between Send
// and the moment [Writer.Pop] returns it, but from [Hooks].Redirect.
type Msg struct {
	// Key identifies the message among its writer's; keys ascend in the order messages are
	// sent (the lanes use the INCOMING sequence).
	Key uint64
	// Stream is the index of the message's stream in the writer's streams.
	Stream int
	// Out is what is published: subject, headers, payload. The writer sets its Reply while it
	// publishes and clears it after.
	Out *nats.Msg

	// Stored says the stream persisted the message, or held it already.
	Stored bool
	// Duplicate says the stream held it already (by its Nats-Msg-Id). It is known only for a
	// message answered on its own: single publishes, and messages sent one at a time.
	Duplicate bool
	// Dropped says the caller gave up on it ([Hooks].Redirect): it is settled, not stored.
	Dropped bool
	// Seq is the stream sequence of the message (of the copy stored first, for a duplicate),
	// when it was answered on its own; 0 otherwise.
	Seq uint64
	// Err is why the last attempt failed; nil while it is in flight and once it is stored.
	Err error

	sent  bool      // published in this attempt
	gen   uint64    // connection generation when sent
	at    time.Time // when sent
	batch uint64    // batch number it was sent in; 0 when sent singly
	bseq  uint64    // its batch sequence
}

// settled tells whether the outcome of m's attempt is known (or it was not sent).
func (m *Msg) settled() bool { return !m.sent || m.Stored || m.Dropped || m.Err != nil }

// inFlight tells whether m was sent and its outcome is not known yet.
func (m *Msg) inFlight() bool { return !m.settled() }

// oneAtATime tells whether t sends one message at a time, each once the one before is answered:
// while it probes, and always when single publishes carry a fence check. On a cluster a stream
// refuses a publish checking a fence while another check of that fence is in process (proposed,
// not yet applied: 10164), and takes the next once it is applied, so pipelined fenced singles
// would store a later message ahead of the refused one (TestFencedSinglesGoOneAtATime: most of a
// burst). A fenced stream takes atomic batches (setup makes it so); singles are its fallback
// (a mode read while the stream elected, or batches refused), slow but in order.
func (t *target) oneAtATime() bool { return t.probe || t.Mode == ModeSingle && t.fenceSubj != "" }

// target is a writer's state for one stream.
type target struct {
	Stream
	// probe: send one message at a time, each answered on its own, until one is stored as new
	// (ModeBatch), or stored at all (ModeSingle, after an unanswered failure).
	probe bool
	// probeThrough, when set, keeps probe on until a message of this key or later is stored:
	// an atomic batch refused whole is sent one message at a time, every one of them.
	probeThrough uint64
	probing      *Msg   // the single publish of a probe in flight
	pending      []*Msg // given, waiting to be sent (behind a probe or a committing batch)

	// ModeBatch
	bn       uint64 // the current batch's number
	open     bool   // batch bn has messages sent and its outcome is not known
	bseq     uint64 // the last batch sequence sent in it
	msgs     []*Msg // its messages, by batch sequence − 1
	acked    uint64 // the highest batch sequence confirmed in it
	commit   bool   // its commit (or an end of batch) was sent
	broken   bool   // it failed: nothing more is sent on it until its outcome is known
	why      error  // why it broke, for its first unconfirmed message
	brokenAt time.Time
	endAt    time.Time // when an end of batch was last sent to learn its outcome
	endSeq   uint64    // the batch sequence of the last end of batch sent; 0: none
	held     *Msg      // given but not sent: it goes out as the next message, or the commit
	flushed  bool      // Flush was called since the last Send

	lastSeq uint64    // the highest stream sequence an answer named
	elected time.Time // when its latest leader was announced, once LeaderGrace has passed

	// ModeAtomic
	fenceSubj, fenceSeq string // the fence's headers; "" when the stream has none
	slot                bool   // the open batch holds one of Slots
}

// Writer publishes messages in order to a few streams and settles their acknowledgements. It is
// not safe for concurrent use: one goroutine sends, reads its [Inbox] and recovers.
type Writer struct {
	in      *Inbox
	id      uint32
	idTok   string
	cfg     Config
	targets []*target

	fenced   error  // set once a stream said the writer is fenced: it sends nothing more
	q        []*Msg // every message given and not popped, in key order
	bn       uint64 // the last batch number given out
	failed   bool
	answered time.Time     // when an answer to this writer last came
	timeout  time.Duration // PublishTimeout, doubled per round of timeouts in a row
	backoff  time.Duration
	buf      []byte // reply subjects are built here
	genSeen  uint64 // the connection's generation when a scan last found nothing sent on an older one
	closed   bool
}

// NewWriter returns a writer of streams whose answers come on in.
func (in *Inbox) NewWriter(streams []Stream, cfg Config) *Writer {
	cfg.setDefaults()
	in.next++
	w := &Writer{in: in, id: in.next, idTok: strconv.FormatUint(uint64(in.next), 10), cfg: cfg,
		timeout: cfg.PublishTimeout, answered: time.Now(), buf: make([]byte, 0, 128)}
	for _, s := range streams {
		if s.Mode == 0 {
			s.Mode = ModeSingle
		}
		w.targets = append(w.targets, &target{Stream: s})
	}
	in.writers[w.id] = w
	return w
}

// Close forgets w: answers for it are dropped from now on, and the slots of its open atomic
// batches are given back.
func (w *Writer) Close() {
	w.freeSlots()
	if !w.closed {
		w.closed = true
		delete(w.in.writers, w.id)
	}
}

// Mode returns how stream i is written now.
func (w *Writer) Mode(i int) Mode { return w.targets[i].Mode }

// Probe makes every batch-mode stream send one message at a time, each answered on its own, until
// one is stored as new: where a previous writer may have stored what this one sends (after a
// claim), its duplicates are then counted exactly. Call it before the first Send.
func (w *Writer) Probe() {
	for _, t := range w.targets {
		if t.Mode != ModeSingle {
			t.probe = true
		}
	}
}

// ProbeAll is [Writer.Probe] for every stream, single-mode ones too: a single-mode stream's
// first message goes alone and the rest once it is stored. A sender whose first message may
// hang (a stream that does not answer) then holds one message in flight, not a window's worth.
func (w *Writer) ProbeAll() {
	for _, t := range w.targets {
		t.probe = true
	}
}

// SetFence makes every batch stream i stores from now on carry a check on its first message (and
// every message sent alone): the stream stores it only while the last message on subject in it
// is at sequence seq, the fence record the caller wrote there. A refusal of that check is the
// end ([ErrFenced]). Fast-ingest batches carry none: a fenced stream is never written in them.
func (w *Writer) SetFence(i int, subject string, seq uint64) {
	t := w.targets[i]
	t.fenceSubj, t.fenceSeq = subject, strconv.FormatUint(seq, 10)
}

// LastSeq returns the highest sequence of stream i that an answer to this writer named: every
// message it stored there so far is at or below it, and it is a floor for where the next go.
func (w *Writer) LastSeq(i int) uint64 { return w.targets[i].lastSeq }

// wrongStream fails m when stream is not its target's (Config.CheckStream).
func (w *Writer) wrongStream(t *target, m *Msg, stream string) bool {
	if !w.cfg.CheckStream || stream == "" || stream == t.Name {
		return false
	}
	m.Err = fmt.Errorf("%w: stream %s stored a message meant for %s (%s)", ErrWrongStream, stream, t.Name, m.Out.Subject)
	w.setFailed()
	return true
}

// setFailed marks w failed, telling OnFail when it was not.
func (w *Writer) setFailed() {
	if !w.failed && w.cfg.OnFail != nil {
		w.cfg.OnFail()
	}
	w.failed = true
}

// Fenced returns [ErrFenced] once the writer was fenced, else nil.
func (w *Writer) Fenced() error { return w.fenced }

// Len returns the messages given and not popped.
func (w *Writer) Len() int { return len(w.q) }

// Failed tells whether a message failed since the last round of resends: send nothing new
// before [Writer.Recover] (or Settled and Resend).
func (w *Writer) Failed() bool { return w.failed }

// Waiting tells whether a message given now would wait rather than go out: a round of resends
// is due, or a stream sends one message at a time (a probe) and one is in flight. A sender that
// hands on one message at a time (the park drain) holds its next one back meanwhile, rather than
// let its writer queue what holds room of a window others share.
func (w *Writer) Waiting() bool {
	if w.failed || w.fenced != nil {
		return true
	}
	for _, t := range w.targets {
		if t.oneAtATime() && (t.probing != nil || t.open || len(t.pending) > 0) {
			return true
		}
	}
	return false
}

// Head returns the oldest message not popped, or nil.
func (w *Writer) Head() *Msg {
	if len(w.q) == 0 {
		return nil
	}
	return w.q[0]
}

// Pop removes and returns the oldest message if it is settled for good (stored or dropped), and
// nil otherwise.
func (w *Writer) Pop() *Msg {
	if len(w.q) == 0 || !(w.q[0].Stored || w.q[0].Dropped) {
		return nil
	}
	m := w.q[0]
	w.q[0] = nil
	w.q = w.q[1:]
	w.backoff = 0
	return m
}

// Keep removes every message after the first n, which must be settled ([Writer.Settled]), and
// returns them: a caller that can give them again later (the park drain reads them from PARKED
// again) holds less meanwhile. What it gives next must have keys above the last one kept.
func (w *Writer) Keep(n int) []*Msg {
	if n >= len(w.q) {
		return nil
	}
	out := slices.Clone(w.q[n:])
	clear(w.q[n:])
	w.q = w.q[:n]
	for _, t := range w.targets {
		t.held, t.pending = nil, nil
	}
	return out
}

// EndBatches ends every open fast-ingest batch whose commit was not sent, to learn its outcome
// ([Writer.endBatch]), and forgets what was given and not sent: a writer that may store nothing
// more (its lane lost its lease) still learns what it stored, so that its checkpoint covers it
// and the next owner does not send it again. It stores nothing new: the end of batch is a copy
// of a message already sent, a duplicate if that was stored and behind a gap if not.
func (w *Writer) EndBatches() {
	for _, t := range w.targets {
		t.held, t.pending = nil, nil
		if t.Mode == ModeBatch && t.open && !t.commit {
			w.endBatch(t)
		}
	}
}

// Drop removes every message and returns them, settled or not: the caller stops.
func (w *Writer) Drop() []*Msg {
	q := w.q
	w.q = nil
	for _, t := range w.targets {
		t.held, t.pending, t.open, t.msgs = nil, nil, false, nil
	}
	w.freeSlots()
	return q
}

// freeSlots gives back the slot of every atomic batch w still has open (it stops): the slots are
// shared by every writer of the stream in the process, and one kept by a writer that is gone
// would never come back. The server may still hold the batch until its own timeout; a batch
// that finds the server's limit reached then is refused and sent again, as any.
func (w *Writer) freeSlots() {
	for _, t := range w.targets {
		if t.slot {
			t.slot = false
			t.Slots.release()
		}
	}
}

// Send publishes m after everything given before, or queues it: behind a batch that is being
// committed, behind a probe, or, after a failure, until the next round of resends. m.Key must be
// above every key given before.
func (w *Writer) Send(m *Msg) {
	m.Stored, m.Duplicate, m.Dropped, m.Seq, m.Err, m.sent = false, false, false, 0, nil, false
	w.q = append(w.q, m)
	if w.failed || w.fenced != nil {
		return // the round of resends sends it
	}
	w.checkGen()
	if w.failed {
		return
	}
	w.dispatch(w.targets[m.Stream], m)
}

// dispatch sends m to t now, or queues it there.
func (w *Writer) dispatch(t *target, m *Msg) {
	switch {
	case t.oneAtATime():
		if t.open || t.probing != nil || len(t.pending) > 0 {
			t.pending = append(t.pending, m)
			return
		}
		if t.Mode == ModeBatch {
			w.sendBatch(t, m, true)
			return
		}
		w.sendSingle(t, m)
		if m.Err == nil {
			t.probing = m
		}
	case len(t.pending) > 0, t.Mode == ModeAtomic:
		// An atomic batch is sent whole when its sender has nothing more ready (Flush).
		t.pending = append(t.pending, m)
	case t.Mode == ModeSingle:
		w.sendSingle(t, m)
	case t.open && (t.commit || t.broken):
		t.pending = append(t.pending, m)
	default:
		if t.held != nil {
			h := t.held
			t.held = nil
			w.sendBatch(t, h, false)
			if w.failed {
				return // m waits for the round of resends
			}
		}
		t.held, t.flushed = m, false
	}
}

// Flush commits what was given and not sent yet: the caller has nothing more ready. A batch is
// committed with its last message; one that is being committed sends what waits as the next
// batch as soon as its answer comes.
func (w *Writer) Flush() {
	if w.failed {
		return
	}
	for _, t := range w.targets {
		t.flushed = true
		w.flushTarget(t)
	}
}

// flushTarget commits t's held message, unless t's batch is being committed (or broken): then
// it goes with the next batch. An atomic stream sends what waits as one batch.
func (w *Writer) flushTarget(t *target) {
	if t.Mode == ModeAtomic {
		if !t.probe && !t.open && len(t.pending) > 0 {
			w.sendAtomic(t)
		}
		return
	}
	if t.Mode != ModeBatch || t.probe || t.held == nil || t.open && (t.commit || t.broken) {
		return
	}
	h := t.held
	t.held = nil
	w.sendBatch(t, h, true)
}

// checkGen fails what was sent on a connection since replaced, before anything is sent on the
// new one: it would overtake what the old one lost.
//
// A scan that finds nothing to fail remembers the connection's generation: while it stays the
// same, every message in flight was sent on it (generations only grow, and a message takes the
// one of its publish), so the next Send skips the scan. The scan over every message given was
// 6% of a busy replica's CPU when it ran at each Send.
func (w *Writer) checkGen() {
	gen := w.in.generation()
	if gen == w.genSeen {
		return
	}
	for _, m := range w.q {
		if m.inFlight() && m.gen != gen {
			w.expire(time.Now(), gen)
			return
		}
	}
	w.genSeen = gen
}

// sentBefore tells whether a message other than m is in flight on a connection older than m's;
// if none is, it remembers m's connection as the one everything in flight went out on.
func (w *Writer) sentBefore(m *Msg) bool {
	for _, o := range w.q {
		if o != m && o.inFlight() && o.gen != m.gen {
			return true
		}
	}
	w.genSeen = m.gen
	return false
}

// beforePublish, when set (by tests only), runs at the start of every publish: a test makes a
// reconnect complete there, inside the window the generation checks guard.
var beforePublish func()

// reply builds a reply subject in w's buffer and returns it as a string sharing the buffer:
// nats.go copies it when it publishes, and the writer clears Out.Reply right after.
func (w *Writer) reply(parts ...any) string {
	b := w.buf[:0]
	for _, p := range parts {
		switch v := p.(type) {
		case string:
			b = append(b, v...)
		case uint64:
			b = strconv.AppendUint(b, v, 10)
		case byte:
			b = append(b, v)
		}
	}
	w.buf = b
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// publish sends m with reply; a failure to even send marks m failed.
//
// A reconnect can complete between the last [Writer.checkGen] (at Send, or never, for a
// message sent from an answer or a timer) and this publish: m would then go out on the new
// connection ahead of what the old one lost. So m is sent only if nothing in flight went out on
// an older connection; otherwise it fails unsent, like a publish that could not be written, and
// the round of resends sends it after them. Nor is it sent while the connection reconnects: a
// connection that buffers publishes meanwhile would send it first on the new one, with the old
// one's generation. What remains is the few statements between these checks and the write: a
// reconnect that completes there (the writer's goroutine descheduled across all of it) is seen
// after the write (errConnChanged), when m may be stored ahead already; on a stream written
// singly that is a reorder the lanes count, as a leader change's; a batch's gap check refuses it.
func (w *Writer) publish(m *Msg, reply string) {
	if beforePublish != nil {
		beforePublish()
	}
	m.sent, m.Stored, m.Duplicate, m.Seq, m.Err = true, false, false, 0, nil
	m.gen, m.at = w.in.generation(), time.Now()
	if m.gen != w.genSeen && w.sentBefore(m) {
		m.Err = errConnChanged
		w.setFailed()
		return
	}
	if !w.in.nc.IsConnected() {
		m.Err = errNotConnected
		w.setFailed()
		return
	}
	m.Out.Reply = reply
	err := w.in.nc.PublishMsg(m.Out)
	m.Out.Reply = ""
	if err != nil {
		m.Err = err
		w.setFailed()
		return
	}
	if w.in.generation() != m.gen {
		// A reconnect completed around this publish: it may have gone out on the new
		// connection ahead of older ones that were lost.
		m.Err = errConnChanged
		w.setFailed()
	}
}

// sendSingle publishes m on its own; its answer comes on <inbox>.<writer>.<key>.
func (w *Writer) sendSingle(t *target, m *Msg) {
	m.batch, m.bseq = 0, 0
	if t.fenceSubj != "" {
		setFence(m.Out, t)
		defer clearFence(m.Out)
	}
	w.publish(m, w.reply(w.in.prefix, w.idTok, byte('.'), m.Key))
}

// The operations of a fast-ingest batch, the next-to-last token of its reply subject
// (nats-server stream.go FastBatchOp*).
const (
	opStart  = '0'
	opAppend = '1'
	opCommit = '2'
	opEOB    = '3'
)

// batchFlow is the most messages the server acknowledges at once (nats-server 2.15
// jetstream_batching.go), the flow the writer asks for.
const batchFlow = "500"

// sendBatch publishes m as the next message of t's batch, starting one if none is open, and
// commits the batch with it when commit is set (a probe is a batch of one, committed).
func (w *Writer) sendBatch(t *target, m *Msg, commit bool) {
	if !t.open {
		w.bn++ // numbered across the writer's streams, so that an answer names its stream's batch
		t.bn = w.bn
		t.open, t.bseq, t.acked, t.commit, t.broken, t.why, t.endSeq = true, 0, 0, false, false, nil, 0
		t.msgs = t.msgs[:0]
	}
	t.bseq++
	op := byte(opAppend)
	switch {
	case commit:
		op = opCommit
	case t.bseq == 1:
		op = opStart
	}
	m.batch, m.bseq = t.bn, t.bseq
	t.msgs = append(t.msgs, m)
	w.publish(m, w.batchReply(t, t.bseq, op))
	if m.Err != nil {
		// Not sent: the server's batch ends before it. Learn its outcome with an end of batch
		// at this sequence.
		t.bseq--
		t.msgs = t.msgs[:len(t.msgs)-1]
		w.breakBatch(t, m.Err)
		if t.bseq == 0 {
			t.open = false
		}
		return
	}
	if commit {
		t.commit = true
	}
}

// batchReply is <inbox>.<uid>w<writer>b<batch>.<flow>.fail.<seq>.<op>.$FI: the token before the
// flow is the batch id, unique on the stream because the inbox's token is.
func (w *Writer) batchReply(t *target, seq uint64, op byte) string {
	return w.reply(w.in.prefix, w.in.uid, byte('w'), w.idTok, byte('b'), t.bn, "."+batchFlow+".fail.", seq, byte('.'), op, ".$FI")
}

// breakBatch stops sending on t's batch: its outcome is learnt from the server.
func (w *Writer) breakBatch(t *target, why error) {
	w.setFailed()
	if !t.broken {
		t.broken, t.why, t.brokenAt = true, why, time.Now()
	}
}

// endBatch ends t's open batch to learn its outcome: it sends the last message of it not known
// stored once more, as the batch's commit at the next sequence. If that message is stored, the
// copy is a duplicate the server skips, and the batch commits; if it was lost, the copy shows the
// gap and the batch ends before it (gap: fail): either way the server answers with the count, or
// says it does not know the batch. (An empty end of batch would do the same, but it reaches
// every core subscriber of the subject as an empty message.) A batch whose every message is
// known stored, or refused, needs no answer: it ends here.
func (w *Writer) endBatch(t *target) {
	var last *Msg
	for _, m := range t.msgs[t.acked:] {
		if !m.Stored && m.Err == nil {
			last = m
		}
	}
	if last == nil {
		w.resolve(t, t.acked, false)
		return
	}
	t.endAt = time.Now()
	last.Out.Reply = w.batchReply(t, t.bseq+1, opCommit)
	err := w.in.nc.PublishMsg(last.Out)
	last.Out.Reply = ""
	if err != nil {
		t.endAt = time.Time{}.Add(1) // try again at the next look
	}
	t.commit = true
	t.bseq++ // the copy took a batch sequence; its answer counts it
	t.endSeq = t.bseq
	t.msgs = append(t.msgs, last)
}

// confirm marks t's batch messages up to batch sequence k stored.
func (w *Writer) confirm(t *target, k uint64) {
	for i := t.acked; i < k && i < uint64(len(t.msgs)); i++ {
		if m := t.msgs[i]; m.Err == nil {
			m.Stored = true
		}
	}
	t.acked = max(t.acked, min(k, uint64(len(t.msgs))))
	w.timeout = w.cfg.PublishTimeout
}

// resolve ends t's batch, stored through batch sequence k: what comes after failed (it was not
// stored), with unknown instead when the outcome beyond what was confirmed is not known.
func (w *Writer) resolve(t *target, k uint64, unknown bool) {
	w.confirm(t, k)
	first := true
	for _, m := range t.msgs[t.acked:] {
		if m.Stored {
			continue
		}
		switch {
		case unknown:
			m.Err = errUnknown
		case m.Err != nil:
		case first && t.why != nil:
			m.Err = t.why
		default:
			m.Err = errBatchEnded
		}
		first = false
		w.setFailed()
	}
	if unknown {
		t.probe = true
	}
	t.open, t.commit, t.broken, t.why = false, false, false, nil
	clear(t.msgs)
	t.msgs = t.msgs[:0]
	w.next(t)
}

// next sends what waits on t once its batch or probe has its outcome.
func (w *Writer) next(t *target) {
	if w.failed || t.open || t.probing != nil {
		return
	}
	// What waited was given before the sender's last Flush (or since, and the sender flushes
	// again): it is committed now, not held until the sender's next Flush, which may be a tick
	// away when nothing new comes.
	flushed := t.flushed
	pending := t.pending
	t.pending = nil
	for i, m := range pending {
		if w.failed {
			t.pending = append(t.pending, pending[i:]...)
			return
		}
		w.dispatch(t, m)
	}
	if flushed {
		t.flushed = true
		w.flushTarget(t)
	}
}

// find returns the message of key, or nil. Answers come in order: it is nearly always the head.
func (w *Writer) find(key uint64) *Msg {
	if len(w.q) == 0 {
		return nil
	}
	if w.q[0].Key == key {
		return w.q[0]
	}
	lo, hi := 0, len(w.q)
	for lo < hi {
		i := int(uint(lo+hi) >> 1)
		switch {
		case w.q[i].Key < key:
			lo = i + 1
		case w.q[i].Key > key:
			hi = i
		default:
			return w.q[i]
		}
	}
	return nil
}

// FirstErr returns the failure of the oldest message that failed, or nil.
func (w *Writer) FirstErr() error {
	for _, m := range w.q {
		if m.Err != nil {
			return m.Err
		}
	}
	return nil
}

// Unanswered tells whether err says nothing about the message itself (a timeout, a stall, a
// reconnect, no stream listening, a lost batch): after one, the stream may be without a leader.
func Unanswered(err error) bool {
	var apiErr *jetstream.APIError
	return err != nil && !errors.As(err, &apiErr)
}

// String describes w's state, for a test that failed.
func (w *Writer) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "writer %d: %d queued, failed %v", w.id, len(w.q), w.failed)
	if len(w.q) > 0 {
		m := w.q[0]
		fmt.Fprintf(&b, "; head key %d sent %v stored %v err %v batch %d age %v", m.Key, m.sent, m.Stored, m.Err, m.batch, time.Since(m.at).Round(time.Millisecond))
	}
	for _, t := range w.targets {
		fmt.Fprintf(&b, "; %s %s probing %v through %d probe %v pending %d open %v batch %d seq %d acked %d commit %v broken %v held %v",
			t.Name, t.Mode, t.probing != nil, t.probeThrough, t.probe, len(t.pending), t.open, t.bn, t.bseq, t.acked, t.commit, t.broken, t.held != nil)
	}
	return b.String()
}
