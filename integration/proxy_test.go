package integration

import (
	"bytes"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"
)

// proxy sits between kvmapper processes and the test's server on loopback, so that a test can
// make a server's death strike while publishes are in flight: HoldAfter lets a given number of
// publishes to some subjects through and then stops forwarding the publishes to them that the
// clients connected at that moment send, everything else still going through (connections made
// later are forwarded as usual), and the server's death, or Cut, closes them and throws away
// what was held. Those publishes reached no server, and their acknowledgements never come:
// what a server dying with unread input loses, held as long as the test needs. An embedded
// server shutting down gracefully, by contrast, answers everything it has read first.
type proxy struct {
	t      *testing.T
	ln     net.Listener
	target string

	mu       sync.Mutex
	cond     *sync.Cond
	prefix   []byte            // the subjects HoldAfter counts
	after    int               // armed when > 0: how many more publishes to prefix to forward
	held     int               // bytes read from held clients and not forwarded
	heldPubs int               // publishes to prefix among them
	holding  map[net.Conn]bool // the client connections whose input is held
	conns    map[net.Conn]bool // every connection, both sides
	// kept holds, per client connection, the publishes held, for Release; to, the server
	// side each is forwarded to; wmu, the lock of each forward, so that Release's write of
	// what was held and the forward's own writes do not interleave.
	kept map[net.Conn][]byte
	to   map[net.Conn]net.Conn
	wmu  map[net.Conn]*sync.Mutex
}

// newProxy listens on a loopback port and forwards every connection to target (host:port).
func newProxy(t *testing.T, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{t: t, ln: ln, target: target, conns: map[net.Conn]bool{}, holding: map[net.Conn]bool{},
		kept: map[net.Conn][]byte{}, to: map[net.Conn]net.Conn{}, wmu: map[net.Conn]*sync.Mutex{}}
	p.cond = sync.NewCond(&p.mu)
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		p.Cut()
	})
	return p
}

// URL is what clients connect to.
func (p *proxy) URL() string { return "nats://" + p.ln.Addr().String() }

func (p *proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close() // the server is down: the client reconnects later
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[s] = true, true
		p.to[c], p.wmu[c] = s, &sync.Mutex{}
		p.mu.Unlock()
		go func() {
			_, _ = io.Copy(c, s)
			p.close(c, s)
		}()
		go func() {
			p.forward(s, c)
			p.close(c, s)
		}()
	}
}

// forward copies from client c to server s, holding back its publishes to p.prefix once the
// proxy holds c.
func (p *proxy) forward(s, c net.Conn) {
	buf := make([]byte, 32<<10)
	var sc pubScan
	var out []byte
	p.mu.Lock()
	wmu := p.wmu[c]
	p.mu.Unlock()
	for {
		n, err := c.Read(buf)
		if n > 0 {
			out = out[:0]
			wmu.Lock()
			p.mu.Lock()
			sc.prefix = p.prefix
			sc.feed(buf[:n], func(seg []byte, pub, end bool) {
				if pub && p.holding[c] {
					p.kept[c] = append(p.kept[c], seg...)
					p.held += len(seg)
					if end {
						p.heldPubs++
						p.cond.Broadcast()
					}
					return
				}
				out = append(out, seg...)
				if pub && end && p.after > 0 {
					if p.after--; p.after == 0 {
						for x := range p.conns {
							p.holding[x] = true
						}
					}
				}
			})
			p.mu.Unlock()
			var werr error
			if len(out) > 0 {
				_, werr = s.Write(out)
			}
			wmu.Unlock()
			if werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *proxy) close(conns ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range conns {
		c.Close()
		delete(p.conns, c)
		delete(p.holding, c)
		delete(p.kept, c)
		delete(p.to, c)
	}
}

// HoldAfter forwards the next n publishes to subjects that start with prefix, from any client,
// and holds every later one the clients connected then send.
func (p *proxy) HoldAfter(prefix string, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	clear(p.holding)
	p.prefix, p.after, p.held, p.heldPubs = []byte(prefix), n, 0, 0
}

// Release forwards what is held, in the order it was sent, and holds nothing from then on: a
// delay on the way, not a loss. (What the clients sent besides went through meanwhile.)
func (p *proxy) Release() {
	p.mu.Lock()
	p.after = 0
	var held []net.Conn
	for c := range p.holding {
		if p.to[c] != nil {
			held = append(held, c)
		}
	}
	p.mu.Unlock()
	for _, c := range held {
		p.mu.Lock()
		wmu := p.wmu[c]
		p.mu.Unlock()
		if wmu == nil {
			continue
		}
		// Under the connection's forward lock: nothing it sends later can overtake what was held.
		wmu.Lock()
		p.mu.Lock()
		data, s := p.kept[c], p.to[c]
		delete(p.kept, c)
		delete(p.holding, c)
		p.mu.Unlock()
		if s != nil && len(data) > 0 {
			_, _ = s.Write(data)
		}
		wmu.Unlock()
	}
	p.mu.Lock()
	clear(p.holding)
	p.mu.Unlock()
}

// WaitHeld waits until the proxy holds at least n publishes to HoldAfter's subjects, or timeout
// passed, and returns how many publishes and bytes it holds.
func (p *proxy) WaitHeld(n int, timeout time.Duration) (pubs, bytes int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	t := time.AfterFunc(timeout, func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.cond.Broadcast()
	})
	defer t.Stop()
	deadline := time.Now().Add(timeout)
	for p.heldPubs < n && time.Now().Before(deadline) {
		p.cond.Wait()
	}
	return p.heldPubs, p.held
}

// Cut closes every connection through the proxy, losing what was held.
func (p *proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
	clear(p.holding)
}

// pubScan follows the NATS client protocol a client writes, across reads, command by command.
type pubScan struct {
	prefix []byte // the subjects whose publishes feed tells apart
	line   []byte // a protocol line not complete yet
	left   int    // payload bytes (with their CRLF) of the current command still to come
	pub    bool   // the current command is a publish to prefix
}

// feed walks b and hands each part of it to emit, in order: a complete protocol line, or a
// part of a payload; pub says the part belongs to a publish (PUB or HPUB) to a subject that
// starts with prefix, end that it completes its command.
func (sc *pubScan) feed(b []byte, emit func(seg []byte, pub, end bool)) {
	for len(b) > 0 {
		if sc.left > 0 {
			k := min(sc.left, len(b))
			sc.left -= k
			emit(b[:k], sc.pub, sc.left == 0)
			b = b[k:]
			continue
		}
		j := bytes.IndexByte(b, '\n')
		if j < 0 {
			sc.line = append(sc.line, b...)
			return
		}
		line := append(sc.line, b[:j+1]...)
		sc.line = nil
		b = b[j+1:]
		sc.pub = false
		// PUB <subject> [reply] <size> and HPUB <subject> [reply] <header size> <total size>:
		// the last field is what follows the line, before its CRLF.
		if f := bytes.Fields(line); len(f) >= 3 {
			switch string(bytes.ToUpper(f[0])) {
			case "PUB", "HPUB":
				if size, err := strconv.Atoi(string(f[len(f)-1])); err == nil {
					sc.left = size + 2
					sc.pub = len(sc.prefix) > 0 && bytes.HasPrefix(f[1], sc.prefix)
				}
			}
		}
		emit(line, sc.pub, sc.left == 0)
	}
}
