package integration

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/wire"

	"github.com/kvmapper/kvmapper/subjects"
)

// wireTap records every publish the mappers make, as it crosses the server: a core NATS
// subscription on outgoing.> and unmapped.> sees each one, including those OUTGOING then drops
// as duplicates and those no stream stores. Markers the test publishes go through the same
// channel, so a marker's position in the record is a boundary in the server's order.
type wireTap struct {
	t      *testing.T
	nc     *nats.Conn
	subs   []*nats.Subscription
	mark   string // subject of the markers
	mu     sync.Mutex
	msgs   []*nats.Msg // in arrival order, markers included
	sent   int         // publishes recorded, markers excluded
	closed chan struct{}
}

// tapWire starts recording; it stops with t.Cleanup.
func (e *env) tapWire() *wireTap {
	e.t.Helper()
	w := &wireTap{t: e.t, mark: nats.NewInbox(), closed: make(chan struct{})}
	w.nc = e.srv.Connect(e.t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	// One channel for all subscriptions: the connection's reader puts messages into it in the
	// order the server sent them.
	ch := make(chan *nats.Msg, 1<<18)
	for _, subj := range []string{"outgoing.>", "unmapped.>", w.mark} {
		sub, err := w.nc.ChanSubscribe(subj, ch)
		if err != nil {
			e.t.Fatal(err)
		}
		w.subs = append(w.subs, sub)
	}
	if err := w.nc.Flush(); err != nil {
		e.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case m := <-ch:
				w.record(m)
			case <-w.closed:
				return
			}
		}
	}()
	e.t.Cleanup(func() {
		close(w.closed)
		<-done
	})
	return w
}

func (w *wireTap) record(m *nats.Msg) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, m)
	if m.Subject == w.mark {
		return
	}
	w.sent++
}

func (w *wireTap) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.sent
}

// marker puts a marker on the record and returns its index once it is there: every publish
// the server routed before the marker is recorded before it, every later one after it.
func (w *wireTap) marker() int {
	w.t.Helper()
	label := strconv.Itoa(int(time.Now().UnixNano()))
	if err := w.nc.Publish(w.mark, []byte(label)); err != nil {
		w.t.Fatal(err)
	}
	idx := -1
	natstest.Eventually(w.t, 30*time.Second, func() error {
		w.mu.Lock()
		defer w.mu.Unlock()
		for i := len(w.msgs) - 1; i >= 0; i-- {
			if m := w.msgs[i]; m.Subject == w.mark && string(m.Data) == label {
				idx = i
				return nil
			}
		}
		return fmt.Errorf("wire marker %s not recorded yet", label)
	})
	return idx
}

// since returns the publishes recorded after index i (markers left out). It fails the test if
// the subscription dropped anything: the record would not be complete.
func (w *wireTap) since(i int) []*nats.Msg {
	w.t.Helper()
	for _, s := range w.subs {
		if n, err := s.Dropped(); err != nil || n > 0 {
			w.t.Fatalf("wire subscription %s dropped %d messages (%v): the record is incomplete", s.Subject, n, err)
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []*nats.Msg
	for _, m := range w.msgs[i+1:] {
		if m.Subject != w.mark {
			out = append(out, m)
		}
	}
	return out
}

// provenance reads a publish's partition, epoch and INCOMING sequence from its headers.
func provenance(t *testing.T, subject string, hdr nats.Header) (p int, epoch, seq uint64) {
	t.Helper()
	pv, ok := wire.ReadProvenance(hdr.Get)
	p, epoch = pv.Partition, pv.Epoch
	// Nats-Msg-Id is INCOMING:<incarnation>:<seq> (wire.MsgIDPrefix), or INCOMING-<p>:… in
	// the partition-streams layout.
	id := hdr.Get(nats.MsgIdHdr)
	i := strings.LastIndexByte(id, ':')
	seq, err3 := strconv.ParseUint(id[i+1:], 10, 64)
	stream := "INCOMING:"
	if !strings.HasPrefix(id, stream) {
		stream = "INCOMING-" + strconv.Itoa(p) + ":"
	}
	if !ok || !pv.HasPartition || epoch == 0 || err3 != nil || !strings.HasPrefix(id, stream) || i < len(stream) {
		t.Fatalf("publish on %s: headers %v lack provenance or a Nats-Msg-Id INCOMING[-<p>]:<incarnation>:<seq>", subject, hdr)
	}
	return p, epoch, seq
}

// partitionSeqs reads the first n messages of INCOMING (all n of the partition streams) and
// returns each partition's stream sequences, in order (the server stamps the partition as the
// subject's second token).
func (e *env) partitionSeqs(n int) map[int][]uint64 {
	e.t.Helper()
	out := map[int][]uint64{}
	msgs := e.incoming(n)
	if e.names.StreamLayout == subjects.SingleStream {
		msgs = msgs[:n]
	} else if len(msgs) != n {
		e.t.Fatalf("the partition streams hold %d messages, want %d", len(msgs), n)
	}
	for _, m := range msgs {
		tok := strings.Split(m.Subject(), ".")
		p, err := strconv.Atoi(tok[1])
		md, merr := m.Metadata()
		if err != nil || merr != nil {
			e.t.Fatalf("INCOMING message on %s: partition %v, metadata %v", m.Subject(), err, merr)
		}
		out[p] = append(out[p], md.Sequence.Stream)
	}
	return out
}

// checkpoint returns partition p's checkpoint in the control bucket, 0 when there is none.
func (e *env) checkpoint(p int) uint64 {
	e.t.Helper()
	ent, err := e.ctl.Get(context.Background(), wire.CheckpointKey(p))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return 0
	}
	if err != nil {
		e.t.Fatalf("Get(%s): %v", wire.CheckpointKey(p), err)
	}
	cp, err := wire.ParseCheckpoint(ent.Value())
	if err != nil {
		e.t.Fatalf("%s = %q: %v", wire.CheckpointKey(p), ent.Value(), err)
	}
	return cp.Seq
}

// metric returns the samples of a metric on a replica's /metrics, by their label set
// ("" for none): `name{partition="3"} 7` gives map[`partition="3"`] = 7.
func metric(t *testing.T, url, name string) map[string]float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `(?:\{([^}]*)\})? (\S+)$`)
	out := map[string]float64{}
	for _, s := range re.FindAllStringSubmatch(httpGet(t, url+"/metrics"), -1) {
		v, err := strconv.ParseFloat(s[2], 64)
		if err != nil {
			t.Fatalf("%s/metrics: %s{%s} = %q: %v", url, name, s[1], s[2], err)
		}
		out[s[1]] = v
	}
	return out
}

// metricsURL returns the base URL of the metrics endpoint a mapper started with
// --metrics-listen 127.0.0.1:0 logged.
func (m *mapper) metricsURL() string {
	m.t.Helper()
	addr, _ := m.waitLog("metrics listening", 10*time.Second)["addr"].(string)
	if addr == "" {
		m.t.Fatalf("%s logged no metrics address", m.id)
	}
	return "http://" + addr
}

// partitionLabel is the label set of a per-partition metric.
func partitionLabel(p int) string { return fmt.Sprintf("partition=%q", strconv.Itoa(p)) }
