package direct

import (
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/subjects"
)

// shape knows where the device token sits in what devices publish (the in template) and how the
// account mapping would write the partition into it, so that with [wire.ReceiveAll] the replica can do
// for itself what the mapping does on the server.
type shape struct {
	partitions int
	prefixDot  string // "incoming.": the in template's leading literal tokens and a dot
	devIdx     int    // index of {device} among the in template's tokens
	tokens     int    // how many tokens the in template has
}

func newShape(lay *subjects.Layout) shape {
	toks := splitSubject(lay.In.String())
	s := shape{partitions: lay.Partitions, prefixDot: lay.In.Prefix() + ".", tokens: len(toks)}
	for i, tok := range toks {
		if tok == "{device}" {
			s.devIdx = i
		}
	}
	return s
}

// device returns the device token of a subject published to the in template, "" when subject
// does not have the template's token count.
func (s shape) device(subject string) string {
	start, idx := 0, 0
	dev := ""
	for i := 0; i <= len(subject); i++ {
		if i < len(subject) && subject[i] != '.' {
			continue
		}
		if idx == s.devIdx {
			dev = subject[start:i]
		}
		idx++
		start = i + 1
	}
	if idx != s.tokens {
		return ""
	}
	return dev
}

// stored writes the partition p into subject, as the account mapping does:
// "incoming.dev-42.temp" becomes "incoming.7.dev-42.temp".
func (s shape) stored(subject string, p int) string {
	return s.prefixDot + strconv.Itoa(p) + subject[len(s.prefixDot)-1:]
}

func splitSubject(s string) []string { return strings.Split(s, ".") }

// routes are the lanes the shared subscription of [wire.ReceiveAll] feeds, by partition (several while
// a partition passes from one lane of the pool to another), and the lanes waiting for a marker of
// theirs, by the marker's value. A routes value is immutable: it is replaced whole.
type routes struct {
	byPartition [][]*lane
	markers     map[string]*lane
}

// dispatch hands one message of the shared subscription to the lanes of its partition. It runs
// on the subscription's delivery goroutine, one message at a time, so each lane receives its
// partition's messages in the order the server sent them.
func (p *Pool) dispatch(m *nats.Msg) {
	rt := p.routes.Load()
	if v := m.Header.Get(HeaderMarker); v != "" && m.Subject == p.markerSubject {
		if l := rt.markers[v]; l != nil {
			if !slices.Contains(rt.byPartition[l.a.Partition], l) {
				// A joining lane's start marker: it is fed from the next message on.
				p.route(l, true, "")
				l.activate()
			}
			l.push(m)
		}
		return
	}
	dev := p.shape.device(m.Subject)
	if dev == "" {
		return // not a device subject; the subscription's wildcard makes this impossible
	}
	part := subjects.Partition(dev, p.shape.partitions)
	ls := rt.byPartition[part]
	if len(ls) == 0 {
		return // another replica's partition
	}
	m.Subject = p.shape.stored(m.Subject, part)
	if len(ls) == 1 {
		ls[0].push(m)
		return
	}
	// Each lane owns what it is given (it adds headers): copy before the first one has it.
	msgs := make([]*nats.Msg, len(ls))
	msgs[0] = m
	for i := 1; i < len(ls); i++ {
		msgs[i] = cloneMsg(m)
	}
	for i, l := range ls {
		l.push(msgs[i])
	}
}

// cloneMsg copies a received message deeply enough for a second lane to change its headers.
func cloneMsg(m *nats.Msg) *nats.Msg {
	c := &nats.Msg{Subject: m.Subject, Reply: m.Reply, Data: m.Data}
	if m.Header != nil {
		c.Header = make(nats.Header, len(m.Header))
		for k, v := range m.Header {
			c.Header[k] = append([]string(nil), v...)
		}
	}
	return c
}
