package natstest

import (
	"bytes"
	"net"
	"strconv"
	"sync"
)

// Dropper is a nats.CustomDialer (nats.SetCustomDialer) whose connections can lose the
// messages they publish to some subjects: the client sends them, the server never sees them,
// and a request among them waits for an answer that does not come — what a client sees of a
// stream that has no leader for a while, on one server. Everything else goes through. It is
// safe for concurrent use.
type Dropper struct {
	mu      sync.Mutex
	rules   []DropRule // the first whose prefix matches a publish decides; none: it goes through
	dropped int
}

// DropRule says which publishes a [Dropper] drops: those to subjects starting with Prefix,
// after the first Pass of them went through; with Next > 0 only the next Next of them, then the
// rule ends.
type DropRule struct {
	Prefix     string
	Pass, Next int
}

// Set replaces what d drops with rules; none: nothing. It returns how many publishes were
// dropped before the change, so that a test switching rules can count what the new ones drop.
func (d *Dropper) Set(rules ...DropRule) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rules = nil
	for _, r := range rules {
		if r.Prefix != "" && r.Next >= 0 {
			d.rules = append(d.rules, r)
		}
	}
	return d.dropped
}

// Drop starts dropping the publishes to subjects that start with prefix, and only those; ""
// stops.
func (d *Dropper) Drop(prefix string) { d.Set(DropRule{Prefix: prefix}) }

// DropNext drops the next n publishes to subjects that start with prefix, then stops dropping:
// what a client sees of a stream that gets a leader back in the middle of what it sends. It
// returns how many publishes were dropped before, as [Dropper.Set].
func (d *Dropper) DropNext(prefix string, n int) int {
	if n <= 0 {
		return d.Set()
	}
	return d.Set(DropRule{Prefix: prefix, Next: n})
}

// DropAfter lets the next n publishes to subjects that start with prefix through, then drops
// every later one: what a client sees of a stream that loses its leader after it has stored
// exactly n of what the client sent.
func (d *Dropper) DropAfter(prefix string, n int) { d.Set(DropRule{Prefix: prefix, Pass: n}) }

// Dropped returns how many publishes were dropped so far.
func (d *Dropper) Dropped() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dropped
}

// drops reports whether a publish to subject is to be dropped, and counts it.
func (d *Dropper) drops(subject []byte) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range d.rules {
		r := &d.rules[i]
		if !bytes.HasPrefix(subject, []byte(r.Prefix)) {
			continue
		}
		if r.Pass > 0 {
			r.Pass--
			return false
		}
		d.dropped++
		if r.Next > 0 {
			if r.Next--; r.Next == 0 {
				d.rules = append(d.rules[:i], d.rules[i+1:]...)
			}
		}
		return true
	}
	return false
}

// Dial implements nats.CustomDialer.
func (d *Dropper) Dial(network, address string) (net.Conn, error) {
	c, err := net.Dial(network, address)
	if err != nil {
		return nil, err
	}
	return &dropConn{Conn: c, d: d}, nil
}

// dropConn parses what the client writes, protocol line by protocol line, and leaves out the
// publishes its Dropper drops. nats.go writes from one goroutine at a time.
type dropConn struct {
	net.Conn
	d    *Dropper
	line []byte // a protocol line not complete yet
	left int    // payload bytes (with their CRLF) of the current command still to come
	drop bool   // the current command is dropped
}

func (c *dropConn) Write(b []byte) (int, error) {
	n := len(b)
	out := make([]byte, 0, len(b))
	for len(b) > 0 {
		if c.left > 0 {
			k := min(c.left, len(b))
			if !c.drop {
				out = append(out, b[:k]...)
			}
			b, c.left = b[k:], c.left-k
			continue
		}
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			c.line = append(c.line, b...)
			break
		}
		line := append(c.line, b[:i+1]...)
		c.line = nil
		b = b[i+1:]
		c.drop, c.left = false, 0
		// PUB <subject> [reply] <size> and HPUB <subject> [reply] <header size> <total size>:
		// the last field is what follows the line, before its CRLF.
		if f := bytes.Fields(line); len(f) >= 3 {
			switch op := string(bytes.ToUpper(f[0])); op {
			case "PUB", "HPUB":
				size, err := strconv.Atoi(string(f[len(f)-1]))
				if err == nil {
					c.left = size + 2
					c.drop = c.d.drops(f[1])
				}
			}
		}
		if !c.drop {
			out = append(out, line...)
		}
	}
	if len(out) > 0 {
		if _, err := c.Conn.Write(out); err != nil {
			return 0, err
		}
	}
	return n, nil
}
