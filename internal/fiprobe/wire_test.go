package fiprobe_test

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The operations of a fast batch, the next-to-last token of its reply subject (nats-server
// stream.go FastBatchOpStart…FastBatchOpPing).
const (
	opStart = iota
	opAppend
	opCommit
	opCommitEOB
	opPing
)

// batch speaks nats-server's fast-ingest batch protocol with core publishes. Every message
// carries the reply subject <inbox>.<flow>.<gap>.<batch seq>.<op>.$FI; the server reads the
// batch id from the token after the inbox prefix and sends every answer (flow acknowledgements,
// gaps, errors, the final PubAck) to the reply subject of the message that caused it, so all
// of them arrive on <inbox>.>.
type batch struct {
	t       testing.TB
	nc      *nats.Conn
	inbox   string // _INBOX.<id>: the batch id is <id>
	flow    int
	gap     string // "fail" or "ok"
	seq     uint64 // last batch sequence sent
	answers chan *nats.Msg
	sub     *nats.Subscription
}

func newBatch(t testing.TB, nc *nats.Conn, flow int, gapOK bool) *batch {
	t.Helper()
	b := &batch{t: t, nc: nc, inbox: nc.NewInbox(), flow: flow, gap: "fail", answers: make(chan *nats.Msg, 1<<16)}
	if gapOK {
		b.gap = "ok"
	}
	var err error
	if b.sub, err = nc.ChanSubscribe(b.inbox+".>", b.answers); err != nil {
		t.Fatalf("ChanSubscribe: %v", err)
	}
	t.Cleanup(func() { _ = b.sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	return b
}

// id is the batch id the server knows the batch by.
func (b *batch) id() string { return b.inbox[strings.LastIndexByte(b.inbox, '.')+1:] }

func (b *batch) reply(seq uint64, op int) string {
	return fmt.Sprintf("%s.%d.%s.%d.%d.$FI", b.inbox, b.flow, b.gap, seq, op)
}

// add sends m as the batch's next message and returns its batch sequence.
func (b *batch) add(m *nats.Msg) uint64 {
	b.t.Helper()
	b.seq++
	op := opAppend
	if b.seq == 1 {
		op = opStart
	}
	m.Reply = b.reply(b.seq, op)
	if err := b.nc.PublishMsg(m); err != nil {
		b.t.Fatalf("PublishMsg %d: %v", b.seq, err)
	}
	return b.seq
}

// commit sends m as the batch's last message.
func (b *batch) commit(m *nats.Msg) {
	b.t.Helper()
	b.seq++
	m.Reply = b.reply(b.seq, opCommit)
	if err := b.nc.PublishMsg(m); err != nil {
		b.t.Fatalf("PublishMsg commit %d: %v", b.seq, err)
	}
}

// end commits the batch without a message of its own (end of batch: the next sequence, no
// payload, on subject, which must be one the stream captures).
func (b *batch) end(subject string) {
	b.t.Helper()
	if err := b.nc.PublishRequest(subject, b.reply(b.seq+1, opCommitEOB), nil); err != nil {
		b.t.Fatalf("PublishRequest EOB: %v", err)
	}
}

// ping asks for the latest flow acknowledgement, naming the last sequence sent.
func (b *batch) ping(subject string) {
	b.t.Helper()
	if err := b.nc.PublishRequest(subject, b.reply(b.seq, opPing), nil); err != nil {
		b.t.Fatalf("PublishRequest ping: %v", err)
	}
}

// answer is anything the server sends to a batch's inbox. Type is "ack", "gap" or "err" for
// the batch's own messages, "" for a PubAck (or an error PubAck, with Error set).
type answer struct {
	Type      string              `json:"type"`
	Seq       uint64              `json:"seq"`      // ack, err: batch sequence; gap: the one that arrived; PubAck: stream sequence
	Msgs      int                 `json:"msgs"`     // ack: the server acknowledges every Msgs messages from now on
	LastSeq   uint64              `json:"last_seq"` // gap: the one expected
	Stream    string              `json:"stream"`
	Batch     string              `json:"batch"`
	Count     uint64              `json:"count"`
	Duplicate bool                `json:"duplicate"`
	Error     *jetstream.APIError `json:"error"`

	On     uint64 // the batch sequence in the reply subject it came on
	Status string // a status header (503: no responders), when there is no body
	Raw    string
}

func (a answer) String() string {
	if a.Status != "" {
		return fmt.Sprintf("on %d: status %s", a.On, a.Status)
	}
	return fmt.Sprintf("on %d: %s", a.On, a.Raw)
}

func parse(t testing.TB, m *nats.Msg) answer {
	t.Helper()
	a := answer{Raw: string(m.Data)}
	// <inbox>.<flow>.<gap>.<seq>.<op>.$FI
	tok := strings.Split(m.Subject, ".")
	if len(tok) >= 4 {
		a.On, _ = strconv.ParseUint(tok[len(tok)-3], 10, 64)
	}
	if len(m.Data) == 0 {
		a.Status = m.Header.Get("Status")
		return a
	}
	if err := json.Unmarshal(m.Data, &a); err != nil {
		t.Fatalf("answer %q on %s: %v", m.Data, m.Subject, err)
	}
	return a
}

// next returns the next answer, failing the test if none comes within wait.
func (b *batch) next(wait time.Duration) answer {
	b.t.Helper()
	select {
	case m := <-b.answers:
		a := parse(b.t, m)
		b.t.Logf("answer %s", a)
		return a
	case <-time.After(wait):
		b.t.Fatalf("no answer within %v", wait)
		return answer{}
	}
}

// until collects answers up to and including the first PubAck (Type ""), failing the test if
// none comes within wait.
func (b *batch) until(wait time.Duration) (flow []answer, pubAck answer) {
	b.t.Helper()
	deadline := time.Now().Add(wait)
	for {
		a := b.next(time.Until(deadline))
		if a.Type == "" && a.Status == "" {
			return flow, a
		}
		flow = append(flow, a)
	}
}

// all collects answers up to and including the batch's own PubAck (one that names the batch),
// then whatever else arrives until nothing has for 300ms, failing the test if the PubAck does
// not come within wait.
func (b *batch) all(wait time.Duration) (got []answer, pubAck answer) {
	b.t.Helper()
	deadline := time.Now().Add(wait)
	for {
		a := b.next(time.Until(deadline))
		got = append(got, a)
		if a.Batch == b.id() {
			pubAck = a
			break
		}
	}
	return append(got, b.quiet(300*time.Millisecond)...), pubAck
}

// quiet collects what arrives until nothing has for idle.
func (b *batch) quiet(idle time.Duration) []answer {
	b.t.Helper()
	var got []answer
	for {
		select {
		case m := <-b.answers:
			a := parse(b.t, m)
			b.t.Logf("answer %s", a)
			got = append(got, a)
		case <-time.After(idle):
			return got
		}
	}
}

// msg is a message for subject with a Nats-Msg-Id, and more headers from kv pairs.
func msg(subject, id string, kv ...string) *nats.Msg {
	m := nats.NewMsg(subject)
	m.Data = []byte("payload " + id)
	if id != "" {
		m.Header.Set(nats.MsgIdHdr, id)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Header.Set(kv[i], kv[i+1])
	}
	return m
}
