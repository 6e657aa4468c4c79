package ordered

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Inbox is the subscription every answer of its writers comes on: PubAcks, batch flow
// acknowledgements, refusals. Its goroutine reads [Inbox.C] and hands each message to
// [Inbox.Handle], which applies it to its writer; a writer that waits for answers
// ([Writer.Wait], [Writer.Recover]) reads C itself and applies answers to whichever writer
// they are for. It is not safe for concurrent use.
type Inbox struct {
	nc     *nats.Conn
	prefix string // "<inbox>.": single replies are prefix + writer + "." + key
	uid    string // the inbox's last token: batch replies start with it
	// bid starts the Nats-Batch-Id of its writers' atomic batches: the uid's last 8 characters.
	// The server stores the id with every message of the batch, and needs it unique only among
	// the stream's open batches: the uid is a nuid, whose last characters count up within a
	// process (by 33–332 at a time) from a random start in each, so two inboxes share them with
	// a chance of one in 62^8 (2×10^14). 14 bytes less per stored message than the whole uid.
	bid     string
	c       chan *nats.Msg
	sub     *nats.Subscription
	writers map[uint32]*Writer
	next    uint32
}

// NewInbox subscribes a new inbox on nc. capacity bounds the answers waiting to be handled:
// make it at least twice the messages that can be in flight (a message can have two answers
// coming: a late one and its resend's), or nats.go drops answers as a slow consumer.
//
// The writers publish nothing while nc is not connected (see [Writer.publish]), so a connection
// that buffers publishes while it reconnects buffers none of theirs; kvmapper's connections do
// not buffer at all (internal/natsconn: ReconnectBufSize -1).
func NewInbox(nc *nats.Conn, capacity int) (*Inbox, error) {
	inbox := nc.NewInbox()
	in := &Inbox{nc: nc, prefix: inbox + ".", uid: inbox[strings.LastIndexByte(inbox, '.')+1:],
		c: make(chan *nats.Msg, capacity), writers: make(map[uint32]*Writer)}
	in.bid = in.uid[max(0, len(in.uid)-8):]
	sub, err := nc.ChanSubscribe(in.prefix+">", in.c)
	if err != nil {
		return nil, fmt.Errorf("ordered: subscribing to acknowledgements: %w", err)
	}
	in.sub = sub
	return in, nil
}

// Close unsubscribes the inbox.
func (in *Inbox) Close() { _ = in.sub.Unsubscribe() }

// C is where the answers arrive. Nobody closes it.
func (in *Inbox) C() <-chan *nats.Msg { return in.c }

// generation counts the connection's reconnects: a message sent in one generation and
// unanswered in a later one was lost, or is being lost.
func (in *Inbox) generation() uint64 { return in.nc.Stats().Reconnects }

// Drain handles the answers already waiting, at most limit of them (limit < 0: all).
func (in *Inbox) Drain(limit int) {
	for ; limit != 0; limit-- {
		select {
		case m := <-in.c:
			in.Handle(m)
		default:
			return
		}
	}
}

// Handle applies one answer to its writer. Answers for writers closed since, and late answers
// for messages settled already, change nothing: a message is sent again only after it failed,
// and a late "stored" for it means its resend is a duplicate anyway.
func (in *Inbox) Handle(m *nats.Msg) {
	rest, ok := strings.CutPrefix(m.Subject, in.prefix)
	if !ok {
		return
	}
	if body, ok := strings.CutSuffix(rest, ".$FI"); ok {
		in.handleBatch(body, m)
		return
	}
	wid, key, ok := strings.Cut(rest, ".")
	if !ok {
		return
	}
	w := in.writer(wid)
	if w == nil {
		return
	}
	if bn, ok := strings.CutPrefix(key, "b"); ok {
		if n, err := strconv.ParseUint(bn, 10, 64); err == nil {
			w.answered = time.Now()
			w.atomicAnswer(n, m)
		}
		return
	}
	k, err := strconv.ParseUint(key, 10, 64)
	if err != nil {
		return
	}
	w.answered = time.Now()
	w.single(k, m)
}

func (in *Inbox) writer(tok string) *Writer {
	id, err := strconv.ParseUint(tok, 10, 32)
	if err != nil {
		return nil
	}
	return in.writers[uint32(id)]
}

// single applies the answer to the single publish of key.
func (w *Writer) single(key uint64, a *nats.Msg) {
	m := w.find(key)
	if m == nil || m.settled() || m.batch != 0 {
		return
	}
	dup, seq, err := parseAck(a)
	if inProcess(err) {
		// A resend of a message whose first publish the stream is still storing: that one's
		// answer comes to the same reply subject and settles it.
		return
	}
	t := w.targets[m.Stream]
	if t.probing == m {
		t.probing = nil
	}
	if err != nil {
		var apiErr *jetstream.APIError
		if t.fenceSubj != "" && errors.As(err, &apiErr) {
			switch apiErr.ErrorCode {
			case errCodeWrongLastSeq:
				w.fenced = ErrFenced
			case errCodeFenceInProcess:
				// Not about the message: the stream is still storing an earlier message that
				// checked the same fence (a batch whose answer was lost, its proposal not yet
				// applied on a cluster that lost its quorum or its leader). Sent again after
				// the pause, as any failure of the stream; taken for the message's refusal it
				// would become a dead letter while the earlier one may yet be stored.
				err = fmt.Errorf("%w: %s (%d)", errFenceInProcess, apiErr.Description, apiErr.ErrorCode)
			}
		}
		m.Err = err
		w.setFailed()
		return
	}
	if w.cfg.CheckStream && w.wrongStream(t, m, ackStream(a.Data)) {
		return
	}
	m.Stored, m.Duplicate, m.Seq = true, dup, seq
	t.lastSeq = max(t.lastSeq, seq)
	w.timeout = w.cfg.PublishTimeout
	if !dup {
		w.overtaken(m)
	}
	// A single-mode stream's probe ends with the first message stored; a batch stream's with
	// the first stored as new: after it, nothing it sends can be stored already.
	if t.probe && (t.Mode == ModeSingle || !dup) && m.Key >= t.probeThrough {
		t.probe, t.probeThrough = false, 0
	}
	w.next(t)
}

// overtaken fails the single publishes that m, just stored as new, overtook: sent before it on
// the same connection to the same stream and still unanswered. A stream stores one connection's
// publishes in the order they arrive and answers in that order (a duplicate or an error is
// answered at once), so they cannot be answered any more: a leader that steps down drops what it
// had queued, and the new one stores what comes next. m is stored ahead of them already;
// resending them now keeps what follows from being stored ahead too.
func (w *Writer) overtaken(m *Msg) {
	for _, x := range w.q {
		if x == m {
			return
		}
		if x.inFlight() && x.batch == 0 && x.gen == m.gen && x.Stream == m.Stream && !x.at.After(m.at) {
			x.Err = errOvertaken
			w.setFailed()
		}
	}
}

// batchAnswer is whatever the server sends a batch: a flow acknowledgement, a gap, a refusal, the
// final PubAck, an error PubAck.
type batchAnswer struct {
	Type      string              `json:"type"`
	Seq       uint64              `json:"seq"`
	LastSeq   uint64              `json:"last_seq"`
	Stream    string              `json:"stream"`
	Batch     string              `json:"batch"`
	Count     uint64              `json:"count"`
	Duplicate bool                `json:"duplicate"`
	Error     *jetstream.APIError `json:"error"`
}

// Error codes of the batch protocol (nats-server 2.15 errors.json) that nats.go has no constants
// for, and the plain refusal a new batch's first message gets when a stream holds too many.
const (
	errCodeBatchDisabled jetstream.ErrorCode = 10205 // the stream does not allow batches
	errCodeBatchUnknown  jetstream.ErrorCode = 10208 // no such batch: ended, forgotten, never started
	errCodeBatchTooMany  jetstream.ErrorCode = 10211 // too many batches open on the stream
)

// handleBatch applies an answer on a batch reply subject, whose body (without ".$FI") is
// <uid>w<writer>b<batch>.<flow>.<gap>.<seq>.<op>.
func (in *Inbox) handleBatch(body string, m *nats.Msg) {
	tok := strings.Split(body, ".")
	if len(tok) != 5 || !strings.HasPrefix(tok[0], in.uid+"w") {
		return
	}
	wid, bn, ok := strings.Cut(tok[0][len(in.uid)+1:], "b")
	if !ok {
		return
	}
	w := in.writer(wid)
	n, err1 := strconv.ParseUint(bn, 10, 64)
	on, err2 := strconv.ParseUint(tok[3], 10, 64)
	if w == nil || err1 != nil || err2 != nil || len(tok[4]) != 1 {
		return
	}
	w.answered = time.Now()
	var t *target
	for _, x := range w.targets {
		if x.Mode == ModeBatch && x.open && x.bn == n {
			t = x
		}
	}
	if t == nil {
		return // a batch whose outcome is known already: a late answer
	}
	w.batchAnswer(t, on, tok[4][0], m)
}

// batchAnswer applies answer a, on the reply subject of batch sequence on (operation op), to t's
// open batch.
func (w *Writer) batchAnswer(t *target, on uint64, op byte, m *nats.Msg) {
	var msg *Msg
	if on >= 1 && on <= uint64(len(t.msgs)) {
		msg = t.msgs[on-1]
	}
	if len(m.Data) == 0 {
		// No responders: nothing took this message (no stream, or one without a leader).
		switch {
		case op == opEOB || on == t.endSeq:
			t.endAt = time.Now() // asked again after a pause (see expire)
		case on == 1:
			w.breakBatch(t, errNoStream)
			if msg != nil {
				msg.Err = errNoStream
			}
			w.resolve(t, 0, false) // no batch was started
		default:
			if msg != nil && msg.Err == nil {
				msg.Err = errNoStream
			}
			w.breakBatch(t, errNoStream)
		}
		return
	}
	var a batchAnswer
	if err := json.Unmarshal(m.Data, &a); err != nil {
		w.breakBatch(t, fmt.Errorf("%w: %q", errBadAck, m.Data))
		return
	}
	switch {
	case a.Type == "ack":
		w.confirm(t, a.Seq)
	case a.Type == "gap":
		w.breakBatch(t, errBatchEnded) // its PubAck follows
	case a.Type == "err":
		if a.Seq >= 1 && a.Seq <= uint64(len(t.msgs)) && a.Error != nil {
			t.msgs[a.Seq-1].Err = a.Error
		}
		w.breakBatch(t, a.Error)
	case a.Error != nil:
		w.batchRefused(t, on, op, msg, a.Error)
	case a.Batch != "":
		if msg != nil && w.wrongStream(t, msg, a.Stream) {
			w.breakBatch(t, msg.Err)
			w.resolve(t, 0, true)
			return
		}
		t.lastSeq = max(t.lastSeq, a.Seq)
		if len(t.msgs) == 1 && a.Count == 1 {
			// A batch of one is answered like a single publish.
			t.msgs[0].Seq, t.msgs[0].Duplicate = a.Seq, a.Duplicate
			if t.probe && !a.Duplicate && t.msgs[0].Key >= t.probeThrough {
				t.probe, t.probeThrough = false, 0
			}
		}
		w.resolve(t, a.Count, false)
	case a.Stream != "":
		// A plain PubAck: the server stored the message as a single publish, it does not know
		// batches (before nats-server 2.14). Each message of the batch is stored so; what else
		// was sent in it is learnt again singly.
		if msg != nil {
			msg.Stored, msg.Seq = true, a.Seq
		}
		w.fallback(t, fmt.Errorf("%w: the server answered a batch message with a plain PubAck", errFallback))
	}
}

// batchRefused applies an error PubAck, which comes on the reply subject of the message it is
// about (or of an end of batch).
func (w *Writer) batchRefused(t *target, on uint64, op byte, msg *Msg, e *jetstream.APIError) {
	switch {
	case e.ErrorCode == errCodeBatchDisabled:
		w.fallback(t, e)
	case (op == opEOB || on == t.endSeq) && e.ErrorCode == errCodeBatchUnknown:
		// The batch is gone (its PubAck was lost, or the server forgot it: a restart, its
		// timeout): what it stored beyond the last confirmation is not known.
		w.resolve(t, t.acked, true)
	case op == opEOB || on == t.endSeq:
		t.endAt = time.Now() // asked again after a pause
	case on == 1:
		// The first message refused: the batch is gone with it; its next messages are
		// refused as unknown.
		if msg != nil {
			msg.Err = e
		}
		w.breakBatch(t, e)
		w.resolve(t, 0, false)
	case e.ErrorCode == errCodeBatchUnknown:
		// A message after the batch ended, or after the server forgot it: its outcome comes
		// with the PubAck, or an end of batch asks for it.
		w.breakBatch(t, errBatchEnded)
	default:
		// Refused before the batch looked at it (too large, say): the batch's next message
		// reads as a gap, and its PubAck follows; without a next one, an end of batch asks.
		if msg != nil {
			msg.Err = e
		}
		w.breakBatch(t, e)
		if on == t.bseq {
			w.endBatch(t)
		}
	}
}

// fallback writes t singly from now on; what its batch had not confirmed is sent again singly.
func (w *Writer) fallback(t *target, why error) {
	if t.Mode != ModeSingle && w.cfg.OnFallback != nil {
		w.cfg.OnFallback(t.Name, why)
	}
	mode := t.Mode
	t.Mode, t.probe, t.probeThrough = ModeSingle, false, 0
	if mode == ModeAtomic {
		w.failAtomic(t, errFallback)
		return
	}
	t.why = errFallback
	w.breakBatch(t, errFallback)
	w.resolve(t, t.acked, false)
}

// expire fails what cannot be answered any more: single publishes sent on a replaced connection
// or older than the timeout, every single publish when the server answered nothing for the stall
// timeout; and breaks batches in the same cases, asking for their outcome with an end of batch.
func (w *Writer) expire(now time.Time, gen uint64) {
	stall := w.cfg.StallTimeout
	stalled := stall > 0 && now.Sub(w.answered) > stall
	timedOut, lost := false, false
	for _, t := range w.targets {
		t.elected = time.Time{}
		if w.cfg.Elected != nil && t.Name != "" {
			if at := w.cfg.Elected(t.Name); now.Sub(at) > w.cfg.LeaderGrace {
				t.elected = at
			}
		}
	}
	for _, m := range w.q {
		if !m.inFlight() || m.batch != 0 {
			continue
		}
		var why error
		switch {
		case m.gen != gen:
			why = nats.ErrDisconnected
		case lost || m.at.Before(w.targets[m.Stream].elected):
			// Sent to a leader that has since handed over, and unanswered: it dropped it. So
			// is every later one taken for lost: it must not be stored before that one's resend.
			why, lost = errLeaderChanged, true
		case now.Sub(m.at) > w.timeout:
			why, timedOut = errAckTimeout, true
		case stalled && (lost || now.Sub(m.at) > stall):
			// Once one is taken for lost, so is every later one: it must not be stored
			// before that one's resend.
			why, lost = errStalled, true
		}
		if why != nil {
			m.Err = why
			w.setFailed()
			if t := w.targets[m.Stream]; t.probing == m {
				t.probing = nil
			}
		}
	}
	for _, t := range w.targets {
		if t.Mode == ModeAtomic {
			if w.expireAtomic(t, now, gen) {
				timedOut = true
			}
			if !t.open && !t.probe && !w.failed && len(t.pending) > 0 && t.flushed {
				w.sendAtomic(t) // a slot may have come free
			}
			continue
		}
		if t.Mode != ModeBatch || !t.open {
			continue
		}
		if !t.broken {
			for _, m := range t.msgs[t.acked:] {
				var why error
				switch {
				case !m.inFlight():
				case m.gen != gen:
					why = nats.ErrDisconnected
				case m.at.Before(t.elected):
					why = errLeaderChanged
				case now.Sub(m.at) > w.timeout:
					why, timedOut = errAckTimeout, true
				case stalled && now.Sub(m.at) > stall:
					why = errStalled
				}
				if why != nil {
					w.breakBatch(t, why)
					break
				}
			}
		}
		if w.failed && !t.commit && !t.broken {
			// Another stream failed: what this batch holds is committed now, so that the
			// round of resends knows its outcome.
			w.endBatch(t)
			continue
		}
		switch {
		case t.broken && now.Sub(t.brokenAt) > w.timeout:
			// Nothing answers its ends of batch either (no stream takes the subject, the
			// server is gone): what it stored beyond the last confirmation is not known.
			w.resolve(t, t.acked, true)
		case t.broken && now.Sub(t.brokenAt) > endWait && now.Sub(t.endAt) > endWait:
			w.endBatch(t)
		}
	}
	if timedOut {
		// A server this slow must not get the whole window again at once: each round of
		// timeouts in a row doubles the wait (up to 4 × PublishTimeout); an answer resets it.
		w.timeout = min(2*w.timeout, 4*w.cfg.PublishTimeout)
	}
}

// endWait is how long a broken batch waits for the PubAck the server sends when it ends a batch
// itself (a gap, a refusal) before the writer asks with an end of batch, and how long between
// two such questions.
const endWait = 250 * time.Millisecond

// Expire fails, as of now, what cannot be answered any more (see [Config]); call it on a tick.
func (w *Writer) Expire(now time.Time) { w.expire(now, w.in.generation()) }

// Settled tells whether every message sent has its outcome: nothing is in flight.
func (w *Writer) Settled() bool {
	for _, t := range w.targets {
		if t.open || t.probing != nil {
			return false
		}
	}
	for _, m := range w.q {
		if m.inFlight() {
			return false
		}
	}
	return true
}
