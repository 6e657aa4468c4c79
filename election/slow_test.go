package election_test

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// slowAnswers is a nats.CustomDialer whose connections receive the answers to their publishes
// to one subject that stored them late, by delay, and everything else on time, refusals
// included: a replicated bucket under load, or just after electing a leader, answers a write
// once a quorum has stored it, and refuses one at once. It recognises an answer by the reply
// subject its request named.
type slowAnswers struct {
	subject []byte // publishes to it are answered late, once on
	delay   time.Duration
	on      atomic.Bool

	mu      sync.Mutex
	replies map[string]bool // reply subjects of those publishes
	late    int             // answers delayed so far
}

// Dial implements nats.CustomDialer.
func (s *slowAnswers) Dial(network, address string) (net.Conn, error) {
	c, err := net.Dial(network, address)
	if err != nil {
		return nil, err
	}
	sc := &slowConn{Conn: c, s: s, frames: make(chan []byte, 1024), done: make(chan struct{})}
	go sc.readFrames()
	return sc, nil
}

func (s *slowAnswers) delayed() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.late
}

type slowConn struct {
	net.Conn
	s      *slowAnswers
	frames chan []byte // what Read hands out, frame by frame; closed when the connection ends
	rest   []byte      // the part of a frame Read has not handed out yet
	wg     sync.WaitGroup
	done   chan struct{}
	once   sync.Once
	err    error
}

// Write notes the reply subject of every publish to the slow subject.
func (c *slowConn) Write(b []byte) (int, error) {
	for _, line := range bytes.Split(b, []byte("\r\n")) {
		f := bytes.Fields(line)
		if len(f) >= 4 && (string(f[0]) == "PUB" || string(f[0]) == "HPUB") && bytes.Equal(f[1], c.s.subject) && c.s.on.Load() {
			c.s.mu.Lock()
			c.s.replies[string(f[2])] = true
			c.s.mu.Unlock()
		}
	}
	return c.Conn.Write(b)
}

// readFrames reads what the server sends, protocol frame by frame, and hands each on at once,
// or after the delay when it is an answer to a slow publish.
func (c *slowConn) readFrames() {
	defer func() {
		c.wg.Wait()
		close(c.frames)
	}()
	r := bufio.NewReader(c.Conn)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			c.err = err
			return
		}
		frame := line
		f := bytes.Fields(line)
		late := false
		if len(f) >= 4 && (string(f[0]) == "MSG" || string(f[0]) == "HMSG") {
			size, err := strconv.Atoi(string(f[len(f)-1]))
			if err != nil {
				c.err = err
				return
			}
			payload := make([]byte, size+2)
			if _, err := io.ReadFull(r, payload); err != nil {
				c.err = err
				return
			}
			frame = append(append([]byte(nil), line...), payload...)
			c.s.mu.Lock()
			if c.s.replies[string(f[1])] {
				delete(c.s.replies, string(f[1]))
				if late = !bytes.Contains(payload, []byte(`"error"`)); late {
					c.s.late++
				}
			}
			c.s.mu.Unlock()
		}
		if !late {
			c.frames <- frame
			continue
		}
		c.wg.Add(1)
		time.AfterFunc(c.s.delay, func() {
			defer c.wg.Done()
			select {
			case c.frames <- frame:
			case <-c.done:
			}
		})
	}
}

func (c *slowConn) Read(b []byte) (int, error) {
	if len(c.rest) == 0 {
		frame, ok := <-c.frames
		if !ok {
			return 0, c.err
		}
		c.rest = frame
	}
	n := copy(b, c.rest)
	c.rest = c.rest[n:]
	return n, nil
}

func (c *slowConn) Close() error {
	c.once.Do(func() { close(c.done) })
	return c.Conn.Close()
}

// TestSlowRenewalAnswersKeepTheLease has the server answer every renewal only after the holder
// stopped waiting for it, for several lease TTLs: each renewal is applied, the next one conflicts
// with it and adopts it. An adopted renewal must extend the lease from when it was sent, or the
// lease runs out on the holder's clock although the server renewed it all along.
func TestSlowRenewalAnswersKeepTheLease(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	// Renewals every 500ms, each waiting for its answer up to max(500ms, 2s/5) = 500ms; the
	// answers come after 800ms.
	slow := &slowAnswers{subject: []byte("$KV." + bucket + ".lease.0"), delay: 800 * time.Millisecond, replies: map[string]bool{}}
	nc, rjs := srv.JetStream(t, nats.SetCustomDialer(slow))
	ends := make(chan error, 1)
	leases := make(chan *election.Lease, 1)
	r := runReplica(t, nc, rjs, "a", 1, func(ctx context.Context, l *election.Lease) error {
		leases <- l
		<-ctx.Done()
		ends <- context.Cause(ctx)
		return nil
	}, func(c *election.Config) { c.LeaseTTL, c.RenewInterval = 2*time.Second, 500*time.Millisecond })
	var l *election.Lease
	select {
	case l = <-leases:
	case <-time.After(10 * time.Second):
		t.Fatalf("partition 0 not claimed within 10s")
	}
	slow.on.Store(true)
	start := time.Now()
	for time.Since(start) < 3*2*time.Second {
		select {
		case cause := <-ends:
			t.Fatalf("Work ended with cause %v after %v of late answers, want partition 0 kept", cause, time.Since(start).Round(time.Millisecond))
		case <-time.After(100 * time.Millisecond):
		}
	}
	ent, err := kv.Get(context.Background(), "lease.0")
	if err != nil {
		t.Fatal(err)
	}
	if !l.Valid() || slow.delayed() < 5 {
		t.Errorf("Valid() = %v with %d answers delayed, want the lease kept through at least 5", l.Valid(), slow.delayed())
	}
	t.Logf("%d renewal answers came late; lease.0 at revision %d", slow.delayed(), ent.Revision())
	if err := r.stop(t); err != nil {
		t.Errorf("Run() = %v", err)
	}
}
