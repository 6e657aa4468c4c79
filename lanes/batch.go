package lanes

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// PROTOTYPE (Config.FastBatch), to measure what nats-server's fast-ingest batches would win on
// the write path (BENCHMARKS-fastbatch.md). A lane sends the messages it maps for OUTGOING for
// the first time in a batch of its own, gap: fail, and everything else singly: resends, and dead
// letters (UNMAPPED is another stream). A batch is ended (end of batch, op 3) at every
// checkpoint tick and before a resend round. It does not keep the duplicate and reorder
// counts for batched messages: the server says nothing per message.

// batchFlow is the most messages the server acknowledges at once (nats-server 2.15
// jetstream_batching.go): the flow a lane asks for.
const batchFlow = 500

// The operations of a fast batch, the next-to-last token of its reply subject.
const (
	batchOpStart  = '0'
	batchOpAppend = '1'
	batchOpEOB    = '3'
)

// Error codes of the batch protocol itself, which say nothing about the message.
const (
	errCodeBatchDisabled    jetstream.ErrorCode = 10205
	errCodeBatchUnknown     jetstream.ErrorCode = 10208
	errCodeBatchTooMany     jetstream.ErrorCode = 10211
	errCodeBatchIncomplete  jetstream.ErrorCode = 10176
	errCodeBatchSeqInvalid  jetstream.ErrorCode = 10206
	errCodeBatchSeqExceeded jetstream.ErrorCode = 10207
)

// errBatchEnded marks a message sent in a batch that ended before it was stored.
var errBatchEnded = errors.New("lanes: the fast batch ended before this message was stored")

// fastBatch is a lane's open fast-ingest batch.
type fastBatch struct {
	n       uint64 // batches this lane started; the open one, if open
	open    bool
	prefix  []byte // <inbox><lane id>-<n>.<flow>.fail.
	seq     uint64 // last batch sequence sent in the open batch
	subject string // a subject OUTGOING captures, for the end-of-batch message
	// tail is the last single publish to OUTGOING; a batch starts only once it has settled, so
	// that a single refused later cannot land behind a batched message.
	tail *entry
}

// sendFresh publishes e, consumed now for the first time: in the lane's batch when batches are
// on and e goes to OUTGOING, singly otherwise.
func (l *lane) sendFresh(e *entry, gen uint64) {
	fb := &l.batch
	if !l.p.cfg.FastBatch || e.reason != "" || (fb.tail != nil && !fb.tail.settled()) {
		l.send(e, gen)
		return
	}
	if !fb.open {
		fb.n++
		fb.open, fb.seq = true, 0
		fb.subject = strings.Clone(e.m.Subject)
		id := l.inbox[:len(l.inbox)-1]
		id = id[strings.LastIndexByte(id, '.')+1:]
		fb.prefix = append(append(append(fb.prefix[:0], l.inbox...), id...), '-')
		fb.prefix = strconv.AppendUint(fb.prefix, fb.n, 10)
		fb.prefix = append(fb.prefix, "."+strconv.Itoa(batchFlow)+".fail."...)
	}
	fb.seq++
	e.batch, e.bseq = fb.n, fb.seq
	op := byte(batchOpAppend)
	if fb.seq == 1 {
		op = batchOpStart
	}
	from := len(e.text)
	e.text = strconv.AppendUint(append(e.text, fb.prefix...), fb.seq, 10)
	e.text = append(e.text, '.', op, '.', '$', 'F', 'I')
	l.publish(e, gen, e.since(from))
}

// endBatch ends the open batch, if any: the server answers with a PubAck naming how far it got.
func (l *lane) endBatch() {
	fb := &l.batch
	if !fb.open {
		return
	}
	fb.open = false
	if fb.seq == 0 {
		return
	}
	reply := string(fb.prefix) + strconv.FormatUint(fb.seq+1, 10) + "." + string(rune(batchOpEOB)) + ".$FI"
	_ = l.p.nc.PublishRequest(fb.subject, reply, nil)
}

// batchAnswer is whatever the server sends a batch: a flow acknowledgement, a gap, an error, the
// final PubAck.
type batchAnswer struct {
	Type    string              `json:"type"`
	Seq     uint64              `json:"seq"`
	LastSeq uint64              `json:"last_seq"`
	Batch   string              `json:"batch"`
	Count   uint64              `json:"count"`
	Error   *jetstream.APIError `json:"error"`
}

// acknowledgeBatch applies an answer to a batch, on a reply subject
// <inbox><lane id>-<n>.<flow>.<gap>.<batch seq>.<op>.$FI.
func (l *lane) acknowledgeBatch(m *nats.Msg) {
	tok := strings.Split(m.Subject, ".")
	if len(tok) < 7 {
		return
	}
	on, _ := strconv.ParseUint(tok[len(tok)-3], 10, 64)
	id := tok[len(tok)-6]
	n, err := strconv.ParseUint(id[strings.LastIndexByte(id, '-')+1:], 10, 64)
	if err != nil {
		return
	}
	var a batchAnswer
	switch {
	case len(m.Data) == 0:
		// No stream took it (503): the batch is gone with it.
		l.endedBatch(n, on, errNoStream)
		return
	case json.Unmarshal(m.Data, &a) != nil:
		return
	}
	now := time.Now()
	switch {
	case a.Type == "ack":
		l.settleBatch(n, a.Seq, now)
	case a.Type == "gap":
		l.endedBatch(n, a.LastSeq, errBatchEnded)
	case a.Type == "err":
		l.endedBatch(n, a.Seq, batchErr(a.Error))
	case a.Batch != "":
		l.settleBatch(n, a.Count, now)
		l.endedBatch(n, a.Count+1, errBatchEnded)
	case a.Error != nil:
		l.endedBatch(n, on, batchErr(a.Error))
	}
}

// batchErr is what a refusal inside a batch means for its message: the server's refusal when it
// is about the message, errBatchEnded when it is about the batch.
func batchErr(e *jetstream.APIError) error {
	if e == nil {
		return errBatchEnded
	}
	switch e.ErrorCode {
	case errCodeBatchDisabled, errCodeBatchUnknown, errCodeBatchTooMany, errCodeBatchIncomplete, errCodeBatchSeqInvalid, errCodeBatchSeqExceeded:
		return errBatchEnded
	}
	return e
}

// settleBatch marks every message of batch n up to batch sequence seq stored.
func (l *lane) settleBatch(n, seq uint64, now time.Time) {
	l.answered = now
	for _, e := range l.q {
		if e.batch == n && e.bseq <= seq && !e.settled() {
			e.acked = true
			l.timeout = l.p.cfg.PublishTimeout
		}
	}
}

// endedBatch fails the messages of batch n from batch sequence from on: the batch ended there,
// with nothing after it stored; the one at from fails with why.
func (l *lane) endedBatch(n, from uint64, why error) {
	l.answered = time.Now()
	if l.batch.open && l.batch.n == n {
		l.batch.open = false
	}
	for _, e := range l.q {
		if e.batch != n || e.bseq < from || e.settled() {
			continue
		}
		e.err = errBatchEnded
		if e.bseq == from {
			e.err = why
		}
		l.failed = true
	}
}
