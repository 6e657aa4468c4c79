package ordered

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Slots bounds the atomic batches open on one stream at once, shared by every writer of a
// process that writes it. It is safe for concurrent use.
type Slots struct {
	free atomic.Int64
}

// NewSlots returns n slots.
func NewSlots(n int) *Slots {
	s := &Slots{}
	s.free.Store(int64(n))
	return s
}

func (s *Slots) acquire() bool {
	if s.free.Add(-1) >= 0 {
		return true
	}
	s.free.Add(1)
	return false
}

func (s *Slots) release() { s.free.Add(1) }

// setFence puts t's fence check on out.
func setFence(out *nats.Msg, t *target) {
	if out.Header == nil {
		out.Header = nats.Header{}
	}
	out.Header[jetstream.ExpectedLastSubjSeqHeader] = []string{t.fenceSeq}
	out.Header[jetstream.ExpectedLastSubjSeqSubjHeader] = []string{t.fenceSubj}
}

// clearFence takes the fence check off out again: it belongs to one publish.
func clearFence(out *nats.Msg) {
	delete(out.Header, jetstream.ExpectedLastSubjSeqHeader)
	delete(out.Header, jetstream.ExpectedLastSubjSeqSubjHeader)
}

// The headers of an atomic batch (nats-server stream.go JSBatchId, JSBatchSeq, JSBatchCommit).
const (
	hdrBatchID     = "Nats-Batch-Id"
	hdrBatchSeq    = "Nats-Batch-Sequence"
	hdrBatchCommit = "Nats-Batch-Commit"
)

// seqValues holds the values "0"… of the batch sequence header, so that a batch allocates none
// for them.
var seqValues = func() [][]string {
	v := make([][]string, maxAtomic+1)
	for i := range v {
		v[i] = []string{strconv.Itoa(i)}
	}
	return v
}()

var commitValue = []string{"1"}

// Error codes of the answers to an atomic batch (nats-server 2.15 errors.json) that nats.go has
// no constants for.
const (
	errCodeWrongLastSeq     jetstream.ErrorCode = 10071 // a fence moved: a newer owner wrote its record
	errCodeFenceInProcess   jetstream.ErrorCode = 10164 // "wrong last sequence" without one: the fence subject is in process
	errCodeAtomicDuplicate  jetstream.ErrorCode = 10201 // some message of the batch is stored already
	errCodeAtomicIncomplete jetstream.ErrorCode = 10176 // the batch lost a message on the way, or was abandoned
	errCodeAtomicDisabled   jetstream.ErrorCode = 10174 // the stream does not allow atomic batches
	errCodeAtomicTooMany    jetstream.ErrorCode = 10210 // too many atomic batches open on the stream
)

// errAtomicRefused marks the messages of an atomic batch the stream refused whole.
var errAtomicRefused = errors.New("ordered: the stream refused the atomic batch")

// errFenceInProcess marks a single publish refused because an earlier message checking the same
// fence was still in process (nats-server 2.15 jetstream_batching.go: a subject with an
// expected-last-subject-sequence check in process refuses the next such check).
var errFenceInProcess = errors.New("ordered: an earlier message checking the fence is still in process")

// sendAtomic sends up to maxAtomic of t's waiting messages as one atomic batch: every message but
// the last staged without a reply subject, the last committing it with the reply subject
// <inbox>.<writer>.b<batch>. The first carries t's fence. When the stream's open batches are
// bounded (Slots) and none is free, it sends nothing: the next Flush, answer or look at what
// expired tries again.
func (w *Writer) sendAtomic(t *target) {
	if t.Slots != nil {
		if !t.Slots.acquire() {
			return
		}
		t.slot = true
	}
	n := min(len(t.pending), maxAtomic)
	batch := t.pending[:n:n]
	t.pending = t.pending[n:]
	if len(t.pending) == 0 {
		t.pending = nil
	}
	w.bn++
	t.bn = w.bn
	t.open, t.commit, t.broken, t.why, t.acked, t.bseq = true, true, false, nil, 0, uint64(n)
	t.msgs = append(t.msgs[:0], batch...)
	idv := []string{w.in.bid + "w" + w.idTok + "b" + strconv.FormatUint(t.bn, 10)}
	gen, now := w.in.generation(), time.Now()
	for i, m := range batch {
		m.sent, m.Stored, m.Duplicate, m.Seq, m.Err = true, false, false, 0, nil
		m.gen, m.at, m.batch, m.bseq = gen, now, t.bn, uint64(i+1)
		h := m.Out.Header
		if h == nil {
			h = nats.Header{}
			m.Out.Header = h
		}
		h[hdrBatchID], h[hdrBatchSeq] = idv, seqValues[i+1]
		if i == 0 && t.fenceSubj != "" {
			setFence(m.Out, t)
		}
		if i == n-1 {
			h[hdrBatchCommit] = commitValue
			m.Out.Reply = w.reply(w.in.prefix, w.idTok, ".b", t.bn)
		}
		err := w.in.nc.PublishMsg(m.Out)
		m.Out.Reply = ""
		delete(h, hdrBatchID)
		delete(h, hdrBatchSeq)
		delete(h, hdrBatchCommit)
		if i == 0 && t.fenceSubj != "" {
			clearFence(m.Out)
		}
		if err != nil {
			// Not all of it sent: the server never sees its commit and abandons it. Nothing of
			// it is stored.
			for _, x := range batch {
				x.Err = err
			}
			w.resolveAtomic(t)
			return
		}
	}
}

// atomicAnswer applies the answer to the commit of atomic batch bn.
func (w *Writer) atomicAnswer(bn uint64, a *nats.Msg) {
	var t *target
	for _, x := range w.targets {
		if x.Mode == ModeAtomic && x.open && x.bn == bn {
			t = x
		}
	}
	if t == nil {
		return // late: the batch's outcome was settled already (timed out)
	}
	if len(a.Data) == 0 {
		w.failAtomic(t, errNoStream) // no stream took the commit: nothing is stored
		return
	}
	var r struct {
		Stream string              `json:"stream"`
		Seq    uint64              `json:"seq"`
		Count  uint64              `json:"count"`
		Error  *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(a.Data, &r); err != nil {
		w.failAtomic(t, fmt.Errorf("%w: %q", errBadAck, a.Data))
		return
	}
	if e := r.Error; e != nil {
		// A refusal of the batch says nothing of which message it was about: the messages fail
		// with an error of the batch, not the stream's refusal of each ([Hooks].Redirect is for
		// a message's own refusal).
		why := fmt.Errorf("%w: %s (%d)", errAtomicRefused, e.Description, e.ErrorCode)
		switch {
		case e.ErrorCode == errCodeWrongLastSeq && t.fenceSubj != "":
			w.fenced = ErrFenced
			why = ErrFenced
		case e.ErrorCode == errCodeAtomicDisabled:
			w.fallback(t, e)
			return
		case e.ErrorCode == errCodeAtomicTooMany:
			// Too many batches open on the stream: the same batch later.
		case e.ErrorCode == errCodeAtomicDuplicate:
			// One of them is stored already (a previous owner's tail, or an earlier attempt
			// whose answer was lost): one at a time, each answered on its own, until one is
			// stored as new.
			t.probe = true
		default:
			// One of them was refused, on the way (the batch is then incomplete) or at the
			// commit: the whole batch one at a time, each answered on its own, says which and
			// why.
			t.probe = true
			t.probeThrough = max(t.probeThrough, t.msgs[len(t.msgs)-1].Key)
		}
		w.failAtomic(t, why)
		return
	}
	if r.Count != uint64(len(t.msgs)) {
		w.failAtomic(t, fmt.Errorf("%w: batch of %d answered with count %d: %q", errBadAck, len(t.msgs), r.Count, a.Data))
		return
	}
	if w.wrongStream(t, t.msgs[len(t.msgs)-1], r.Stream) {
		w.failAtomic(t, t.msgs[len(t.msgs)-1].Err)
		return
	}
	t.lastSeq = max(t.lastSeq, r.Seq)
	// Stored whole, in order, ending at r.Seq.
	first := r.Seq - r.Count + 1
	for i, m := range t.msgs {
		m.Stored, m.Seq = true, first+uint64(i)
	}
	w.timeout = w.cfg.PublishTimeout
	w.resolveAtomic(t)
}

// failAtomic fails every message of t's batch with err: an atomic batch is stored whole or not
// at all.
func (w *Writer) failAtomic(t *target, err error) {
	for _, m := range t.msgs {
		m.Err = err
	}
	w.resolveAtomic(t)
}

// resolveAtomic ends t's atomic batch, its messages' outcomes set, and frees its slot.
func (w *Writer) resolveAtomic(t *target) {
	for _, m := range t.msgs {
		if !m.Stored && m.Err == nil {
			m.Err = errBatchEnded
		}
		if m.Err != nil {
			w.setFailed()
		}
	}
	t.open, t.commit, t.broken, t.why = false, false, false, nil
	clear(t.msgs)
	t.msgs = t.msgs[:0]
	if t.slot {
		t.slot = false
		t.Slots.release()
	}
	w.next(t)
}

// expireAtomic fails t's atomic batch when its answer cannot come any more: sent on a replaced
// connection, or older than the timeout. Its outcome is then unknown: sent again whole, it is
// refused as a duplicate if it was stored, and sent one at a time.
func (w *Writer) expireAtomic(t *target, now time.Time, gen uint64) (timedOut bool) {
	if !t.open || len(t.msgs) == 0 {
		return false
	}
	m := t.msgs[len(t.msgs)-1]
	switch {
	case m.gen != gen:
		w.failAtomic(t, nats.ErrDisconnected)
	case m.at.Before(t.elected):
		w.failAtomic(t, errLeaderChanged)
	case now.Sub(m.at) > w.timeout:
		w.failAtomic(t, errAckTimeout)
		return true
	}
	return false
}
