package integration

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// proxy sits between kvmapper processes and the test's server on loopback, so that a test can
// make a server's death strike while publishes are in flight: Hold stops forwarding what the
// clients of the connections open then send (the proxy keeps reading it, so the clients go on
// writing; connections made later are forwarded as usual), and the server's death, or Cut,
// closes them and throws away what was held. Those publishes reached no server, and their
// acknowledgements never come: exactly what a server dying with unread input loses. An embedded
// server shutting down gracefully, by contrast, answers everything it has read first.
type proxy struct {
	t      *testing.T
	ln     net.Listener
	target string

	mu      sync.Mutex
	cond    *sync.Cond
	held    int               // bytes read from held clients and not forwarded since Hold
	holding map[net.Conn]bool // the client connections whose input is held
	conns   map[net.Conn]bool // every connection, both sides
}

// newProxy listens on a loopback port and forwards every connection to target (host:port).
func newProxy(t *testing.T, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{t: t, ln: ln, target: target, conns: map[net.Conn]bool{}, holding: map[net.Conn]bool{}}
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

// forward copies from client c to server s, holding back what it reads while the proxy holds.
func (p *proxy) forward(s, c net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			p.mu.Lock()
			held := p.holding[c]
			if held {
				p.held += n
				p.cond.Broadcast()
			}
			p.mu.Unlock()
			if !held {
				if _, werr := s.Write(buf[:n]); werr != nil {
					return
				}
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
	}
}

// Hold stops forwarding what the clients connected now send, and waits until they have sent at
// least bytes since, or timeout passed: publishes in flight that no server will see. It returns
// the bytes held.
func (p *proxy) Hold(bytes int, timeout time.Duration) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	clear(p.holding)
	p.held = 0
	for c := range p.conns {
		p.holding[c] = true // server sides too: they are never read by forward
	}
	t := time.AfterFunc(timeout, func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.cond.Broadcast()
	})
	defer t.Stop()
	deadline := time.Now().Add(timeout)
	for p.held < bytes && time.Now().Before(deadline) {
		p.cond.Wait()
	}
	return p.held
}

// Cut closes every connection through the proxy, losing what Hold held.
func (p *proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
	clear(p.holding)
}
