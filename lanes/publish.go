package lanes

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A lane publishes with nats.Conn.PublishMsg and a reply subject on its own inbox, and reads the
// stream's acknowledgements from that inbox on its own goroutine: the reply subject ends with the
// INCOMING sequence, so each acknowledgement finds its entry. This replaces nats.go's
// PublishMsgAsync, whose futures cost two channels, a timer and a JSON decode per message, and
// whose own resend on "no responders" fires on a timer, out of order with the lane's resends.

var (
	// errAckTimeout marks a publish whose acknowledgement did not come within PublishTimeout.
	errAckTimeout = errors.New("lanes: no acknowledgement within the publish timeout")
	// errNoStream marks a publish nothing answered at once ("no responders"): no stream
	// captures the subject, or the stream that does has no leader (on a cluster, while it
	// elects one).
	errNoStream = errors.New("lanes: no stream took the message: OUTGOING or UNMAPPED does not exist (run kvmapper setup) or, on a cluster, is electing its leader")
	// errBadAck marks an acknowledgement the lane cannot read.
	errBadAck = errors.New("lanes: unreadable acknowledgement")
	// errStalled marks a publish in flight when the server had answered nothing for
	// StallTimeout: the output stream has likely lost its leader.
	errStalled = errors.New("lanes: no answer from the server within the stall timeout (the stream may have no leader)")
	// errLeaderChanged marks a publish sent before its stream's new leader was announced, and
	// still unanswered a moment after: the old leader dropped it when it stepped down.
	errLeaderChanged = errors.New("lanes: the output stream changed leader; unanswered publishes sent before are resent in order")
	// errOvertaken marks a publish that a later one to the same stream, on the same connection,
	// overtook: the stream answers in the order it stores, so the earlier one was lost (a
	// leader that stepped down drops what it had queued).
	errOvertaken = errors.New("lanes: a later publish was stored first: this one was lost (the stream changed leader)")
)

// subscribeAcks subscribes the lane's inbox. The channel holds twice the pool's in-flight bound:
// an entry can have two acknowledgements coming (a late one and its resend's), and a full
// channel would make nats.go drop acknowledgements as a slow consumer.
func (l *lane) subscribeAcks() (func(), error) {
	l.inbox = l.p.nc.NewInbox() + "."
	l.acks = make(chan *nats.Msg, 2*l.p.cfg.MaxInFlight+64)
	sub, err := l.p.nc.ChanSubscribe(l.inbox+"*", l.acks)
	if err != nil {
		return nil, fmt.Errorf("lanes: subscribing to acknowledgements: %w", err)
	}
	return func() { _ = sub.Unsubscribe() }, nil
}

// send publishes e; gen is the connection generation the caller read just before (it checked
// it against the oldest publish in flight). A failure to even send (disconnected, too large for
// the connection) marks e failed. The generation is read once more after the publish: two
// locked reads of the connection's statistics per message, not three.
func (l *lane) send(e *entry, gen uint64) {
	e.acked, e.duplicate, e.err = false, false, nil
	e.gen = gen
	e.sent = time.Now()
	e.msg.Reply = e.reply
	if err := l.p.nc.PublishMsg(e.msg); err != nil {
		e.err = err
		l.failed = true
		return
	}
	if l.p.generation() != e.gen {
		// A reconnect completed around this publish: it may have gone out on the new
		// connection ahead of older ones that were lost. Resend from the first unacknowledged.
		e.err = nats.ErrDisconnected
		l.failed = true
	}
}

// drainAcks applies the acknowledgements already queued, without waiting, at most limit of them
// (limit < 0: all).
func (l *lane) drainAcks(limit int) {
	for ; limit != 0; limit-- {
		select {
		case m := <-l.acks:
			l.acknowledge(m)
		default:
			return
		}
	}
}

// acknowledge applies one acknowledgement to its entry. Late acknowledgements, for entries
// already settled or gone, change nothing: an entry is resent only after it failed, and a late
// "stored" for it would mean the resend is a duplicate anyway.
func (l *lane) acknowledge(m *nats.Msg) {
	l.answered = time.Now()
	seq, err := strconv.ParseUint(m.Subject[strings.LastIndexByte(m.Subject, '.')+1:], 10, 64)
	if err != nil {
		return
	}
	e := l.find(seq)
	if e == nil || e.settled() {
		return
	}
	e.duplicate, e.out, e.err = parseAck(m)
	if inProcess(e.err) {
		// A resend of a message whose first publish the stream is still storing: that one's
		// answer comes to the same reply subject and settles it.
		e.err = nil
		return
	}
	if e.err != nil {
		l.failed = true
		return
	}
	e.acked = true
	if !e.duplicate {
		l.ro.noteNew(e)
		l.overtaken(e)
	}
	l.timeout = l.p.cfg.PublishTimeout
}

// overtaken fails the publishes that e, just stored as new, overtook: sent before it on the same
// connection to the same stream and still unanswered. A stream stores one connection's publishes
// in the order they arrive and answers in that order (a duplicate or an error is answered at
// once, before anything sent after it is stored), so they cannot be answered any more: a leader
// that steps down drops what it had queued, and the new one stores what comes next. e is stored
// ahead of them already; resending them now keeps what follows from being stored ahead too.
func (l *lane) overtaken(e *entry) {
	for _, x := range l.q {
		if x == e {
			return
		}
		if !x.settled() && x.gen == e.gen && streamOf(x) == streamOf(e) && !x.sent.After(e.sent) {
			x.err = errOvertaken
			l.failed = true
		}
	}
}

// find returns the in-flight entry of INCOMING sequence seq, or nil. Acknowledgements come in
// order, so it is nearly always the head.
func (l *lane) find(seq uint64) *entry {
	if len(l.q) == 0 {
		return nil
	}
	if l.q[0].seq == seq {
		return l.q[0]
	}
	i, lo, hi := 0, 0, len(l.q)
	for lo < hi {
		i = int(uint(lo+hi) >> 1)
		switch {
		case l.q[i].seq < seq:
			lo = i + 1
		case l.q[i].seq > seq:
			hi = i
		default:
			return l.q[i]
		}
	}
	return nil
}

// expire fails the entries whose acknowledgement cannot come any more: those sent on a
// connection that has since been replaced, those older than the current acknowledgement timeout
// (PublishTimeout, longer after rounds of timeouts in a row) and, when the server has answered
// nothing for StallTimeout although the oldest of them was sent longer ago than that, all of
// them: a stream whose leader died stores nothing until it has a new one, and then stores what
// comes next, so they must be resent before anything new is.
func (l *lane) expire(now time.Time) {
	gen := l.p.generation()
	stall := l.p.cfg.StallTimeout
	stalled := stall > 0 && now.Sub(l.answered) > stall
	timedOut, lost := false, false
	var elected [3]time.Time // by streamOf: when the stream's latest leader was announced
	for i, name := range [3]string{l.p.cfg.Outgoing, l.p.cfg.Unmapped, l.p.cfg.Park.Stream} {
		if name != "" {
			if at := l.p.leaders.elected(name); now.Sub(at) > leaderGrace {
				elected[i] = at
			}
		}
	}
	for _, e := range l.q {
		switch {
		case e.settled():
		case e.gen != gen:
			e.err = nats.ErrDisconnected
			l.failed = true
		case lost || e.sent.Before(elected[streamOf(e)]):
			// Sent to a leader that has since handed over, and unanswered: it dropped it. So is
			// every later one taken for lost: it must not be stored before that one's resend.
			e.err = errLeaderChanged
			l.failed, lost = true, true
		case now.Sub(e.sent) > l.timeout:
			e.err = errAckTimeout
			l.failed = true
			timedOut = true
		case stalled && (lost || now.Sub(e.sent) > stall):
			// Once one is taken for lost, so is every later one: it must not be stored
			// before that one's resend.
			e.err = errStalled
			l.failed, lost = true, true
		}
	}
	if timedOut {
		// A server this slow must not get the whole window again at once: each round of
		// timeouts in a row doubles the wait (up to 4 × PublishTimeout); an acknowledgement
		// resets it.
		l.timeout = min(2*l.timeout, 4*l.p.cfg.PublishTimeout)
	}
}

// settle waits until every in-flight entry is acknowledged or failed. It returns ctx's error if
// ctx ends first.
func (l *lane) settle(ctx context.Context) error {
	for {
		l.drainAcks(-1)
		l.expire(time.Now())
		unsettled := false
		for _, e := range l.q {
			if !e.settled() {
				unsettled = true
				break
			}
		}
		if !unsettled {
			return nil
		}
		if err := l.wait(ctx); err != nil {
			return err
		}
	}
}

// wait waits for one acknowledgement or for the next expiry check, whichever comes first.
func (l *lane) wait(ctx context.Context) error {
	t := time.NewTimer(min(l.p.cfg.PublishTimeout/4, 100*time.Millisecond))
	defer t.Stop()
	select {
	case m := <-l.acks:
		l.acknowledge(m)
	case now := <-t.C:
		l.expire(now)
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

var (
	ackError     = []byte(`"error"`)
	ackDuplicate = []byte(`"duplicate"`)
	ackSeq       = []byte(`"seq"`)
	ackTrue      = []byte("true")
)

// parseAck reads a JetStream publish acknowledgement without decoding JSON on the happy path:
// {"stream":"OUTGOING","seq":12} or with "duplicate":true, where seq is the sequence of the copy
// stored first. An error answer is decoded into the server's *jetstream.APIError; a "no
// responders" status means no stream captures the subject.
func parseAck(m *nats.Msg) (duplicate bool, seq uint64, err error) {
	if len(m.Data) == 0 {
		if m.Header.Get("Status") == "503" {
			return false, 0, errNoStream
		}
		return false, 0, errBadAck
	}
	if bytes.Contains(m.Data, ackError) {
		var r struct {
			Error *jetstream.APIError `json:"error"`
		}
		if json.Unmarshal(m.Data, &r) != nil || r.Error == nil {
			return false, 0, fmt.Errorf("%w: %q", errBadAck, m.Data)
		}
		return false, 0, r.Error
	}
	seqAt := afterKey(m.Data, ackSeq)
	if seqAt < 0 {
		return false, 0, fmt.Errorf("%w: %q", errBadAck, m.Data)
	}
	for ; seqAt < len(m.Data) && '0' <= m.Data[seqAt] && m.Data[seqAt] <= '9'; seqAt++ {
		seq = seq*10 + uint64(m.Data[seqAt]-'0')
	}
	// The server writes "duplicate": true with a space, a JSON encoder without one.
	dupAt := afterKey(m.Data, ackDuplicate)
	return dupAt >= 0 && bytes.HasPrefix(m.Data[dupAt:], ackTrue), seq, nil
}

// afterKey returns where the value of key (quoted) starts in the JSON object b, or -1.
func afterKey(b, key []byte) int {
	i := bytes.Index(b, key)
	if i < 0 {
		return -1
	}
	for i += len(key); i < len(b) && (b[i] == ':' || b[i] == ' '); i++ {
	}
	return i
}

// errCodeDuplicateInProcess is nats-server's JSStreamDuplicateMessageConflict, "duplicate
// message id is in process", which nats.go has no constant for: the stream is storing a message
// with the same Nats-Msg-Id (a publish whose answer the lane stopped waiting for) and has not
// finished.
const errCodeDuplicateInProcess jetstream.ErrorCode = 10158

// inProcess tells the answer to a publish whose message the stream is already storing under an
// earlier publish (see [errCodeDuplicateInProcess]).
func inProcess(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeDuplicateInProcess
}
