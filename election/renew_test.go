package election_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// replyGate is a nats.CustomDialer whose connections can stop receiving what the server sends,
// as a network that loses the answer to a request the server has applied. Once armed, the first
// write of a message whose protocol line contains match starts holding that connection's
// incoming bytes, before the write goes out, so that the answer to it is among them. They are
// held until any connection writes match again (then they arrive late, in order) or until the
// connection is closed (then they are lost with it).
type replyGate struct {
	match []byte

	mu      sync.Mutex
	armed   bool
	held    *gatedConn    // the connection being held, if any
	hold    chan struct{} // closed to let held reads return
	tripped chan struct{} // closed when the armed gate starts holding
	written []byte        // what the connection wrote when the gate tripped
}

func newReplyGate(match string) *replyGate {
	return &replyGate{match: []byte(match), tripped: make(chan struct{})}
}

// Dial implements nats.CustomDialer.
func (g *replyGate) Dial(network, address string) (net.Conn, error) {
	c, err := net.Dial(network, address)
	if err != nil {
		return nil, err
	}
	return &gatedConn{Conn: c, g: g, closed: make(chan struct{})}, nil
}

// arm makes the next write of match start holding.
func (g *replyGate) arm() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed = true
}

// expected returns the Nats-Expected-Last-Subject-Sequence of the write that tripped the gate:
// the revision the held renewal was sent on.
func (g *replyGate) expected(t *testing.T) uint64 {
	t.Helper()
	g.mu.Lock()
	defer g.mu.Unlock()
	re := regexp.MustCompile(regexp.QuoteMeta(jetstream.ExpectedLastSubjSeqHeader) + `:\s*(\d+)`)
	i := bytes.Index(g.written, g.match)
	m := re.FindSubmatch(g.written[max(i, 0):])
	if i < 0 || m == nil {
		t.Fatalf("the tripping write has no %s header: %q", jetstream.ExpectedLastSubjSeqHeader, g.written)
	}
	n, err := strconv.ParseUint(string(m[1]), 10, 64)
	if err != nil {
		t.Fatalf("ParseUint(%q): %v", m[1], err)
	}
	return n
}

func (g *replyGate) wrote(c *gatedConn, b []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.armed:
		g.armed = false
		g.held, g.hold = c, make(chan struct{})
		g.written = slices.Clone(b)
		close(g.tripped)
	case g.hold != nil:
		close(g.hold)
		g.held, g.hold = nil, nil
	}
}

// holding returns the channel a read on c must wait for, or nil.
func (g *replyGate) holding(c *gatedConn) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.held != c {
		return nil
	}
	return g.hold
}

type gatedConn struct {
	net.Conn
	g         *replyGate
	closeOnce sync.Once
	closed    chan struct{}
}

func (c *gatedConn) Write(b []byte) (int, error) {
	if bytes.Contains(b, c.g.match) {
		c.g.wrote(c, b)
	}
	return c.Conn.Write(b)
}

// Read delays what it read while the connection is held: a read already waiting when the hold
// starts returns its bytes only when the hold ends.
func (c *gatedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if hold := c.g.holding(c); hold != nil {
		select {
		case <-hold:
		case <-c.closed:
			return 0, net.ErrClosed
		}
	}
	return n, err
}

func (c *gatedConn) Close() error {
	c.closeOnce.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// gatedTTL is the lease TTL of the lost-answer tests: renewals every second, and 2.75s between
// a renewal and the end of the lease it extends, wide margins on a loaded machine.
const gatedTTL = 4 * time.Second

// gated is replica "a" owning partition 0 on a connection through a replyGate.
type gated struct {
	srv   *natstest.Server
	gate  *replyGate
	r     *replica
	kv    jetstream.KeyValue // the test's own view of the bucket
	lease *election.Lease
	ends  chan error // the cause of Work's context when Work returns
}

func startGated(t *testing.T) *gated {
	t.Helper()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	g := &gated{srv: srv, gate: newReplyGate(" $KV." + bucket + ".lease.0 "), kv: newBucket(t, js), ends: make(chan error, 1)}
	nc, rjs := srv.JetStream(t, nats.SetCustomDialer(g.gate))
	leases := make(chan *election.Lease, 1)
	g.r = runReplica(t, nc, rjs, "a", 1, func(ctx context.Context, l *election.Lease) error {
		leases <- l
		<-ctx.Done()
		g.ends <- context.Cause(ctx)
		return nil
	}, func(c *election.Config) { c.LeaseTTL = gatedTTL })
	select {
	case g.lease = <-leases:
	case <-time.After(10 * time.Second):
		t.Fatalf("partition 0 not claimed within 10s")
	}
	return g
}

// loseReply holds the replica's incoming bytes from the send of its next renewal and returns
// the revision at which the server stored that renewal, once it has.
func (g *gated) loseReply(t *testing.T) uint64 {
	t.Helper()
	g.gate.arm()
	select {
	case <-g.gate.tripped:
	case <-time.After(2 * gatedTTL):
		t.Fatalf("no renewal sent within %v", 2*gatedTTL)
	}
	return g.storedAfter(t, g.gate.expected(t), 2*time.Second)
}

// storedAfter waits until lease.0 holds a renewal by "a" at a revision above rev and returns
// that revision. It fails the test at once if Work ends meanwhile.
func (g *gated) storedAfter(t *testing.T, rev uint64, timeout time.Duration) uint64 {
	t.Helper()
	var got uint64
	natstest.Eventually(t, timeout, func() error {
		select {
		case cause := <-g.ends:
			t.Fatalf("Work ended with cause %v, want partition 0 kept", cause)
		default:
		}
		ent, err := g.kv.Get(context.Background(), "lease.0")
		if err != nil {
			return fmt.Errorf("Get(lease.0): %w", err)
		}
		if ent.Revision() <= rev || string(ent.Value()) != "a" {
			return fmt.Errorf("lease.0 = %q at revision %d, want a renewal by a after revision %d", ent.Value(), ent.Revision(), rev)
		}
		got = ent.Revision()
		return nil
	})
	return got
}

// keeps checks that the replica still owns partition 0 under the same lease, and that stopping
// it releases the partition and deletes the lease at once.
func (g *gated) keeps(t *testing.T) {
	t.Helper()
	if !g.lease.Valid() {
		t.Errorf("Lease.Valid() = false, want the lease kept")
	}
	if got := g.r.e.Owned(); !slices.Equal(got, []int{0}) {
		t.Errorf("Owned() = %v, want [0]", got)
	}
	g.releases(t)
}

// releases stops the replica and checks that Work ended by release and the lease key is gone
// when Run returns, deleted rather than left to expire.
func (g *gated) releases(t *testing.T) {
	t.Helper()
	if err := g.r.stop(t); err != nil {
		t.Errorf("Run() = %v, want nil", err)
	}
	select {
	case cause := <-g.ends:
		if !errors.Is(cause, election.ErrReleased) {
			t.Errorf("Work cause = %v, want ErrReleased", cause)
		}
	default:
		t.Errorf("Run returned before Work did")
	}
	if err := keyGone(t, g.kv, "lease.0"); err != nil {
		t.Errorf("after Run returned: %v, want the released lease deleted", err)
	}
}

// TestRenewalAnswerLostInReconnect has the server apply a renewal whose answer is lost in a
// reconnect (nats.go fails the pending request with ErrDisconnected): the holder's next renewal
// conflicts with its own, and it must recognise it, adopt the stored revision and keep the lease.
func TestRenewalAnswerLostInReconnect(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	g := startGated(t)
	lost := g.loseReply(t)
	if err := g.r.nc.ForceReconnect(); err != nil {
		t.Fatalf("ForceReconnect: %v", err)
	}
	next := g.storedAfter(t, lost, 2*gatedTTL)
	t.Logf("renewal stored at revision %d, its answer lost in a reconnect; renewed again at %d", lost, next)
	g.keeps(t)
}

// TestRenewalAnswerTimedOut has the server apply a renewal whose answer comes only after the
// holder gave up waiting for it: its next renewal, sent while the lease still holds, conflicts
// with its own, and it must adopt the stored revision and keep the lease.
func TestRenewalAnswerTimedOut(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	g := startGated(t)
	lost := g.loseReply(t)
	// The gate lets the late answer through when the holder sends its next renewal.
	next := g.storedAfter(t, lost, 2*gatedTTL)
	t.Logf("renewal stored at revision %d, its answer late; renewed again at %d", lost, next)
	g.keeps(t)
}

// TestReleaseAfterLostRenewalAnswer releases a partition right after a renewal whose answer was
// lost: the revision-checked delete conflicts with the holder's own renewal, and it must adopt
// it and delete the lease rather than leave it to expire.
func TestReleaseAfterLostRenewalAnswer(t *testing.T) {
	t.Parallel()
	// The release must come before the next renewal (due a second later), which would find the
	// lost one and adopt it: a wire tap on the lease's subject shows which came first, and a
	// round the renewal won is run again, up to three.
	for round := 1; ; round++ {
		g := startGated(t)
		tap := g.srv.Connect(t)
		sub, err := tap.SubscribeSync("$KV." + bucket + ".lease.0")
		if err != nil {
			t.Fatal(err)
		}
		g.loseReply(t)
		// The lost renewal was stored, so routed to the tap before the flush's answer.
		if err := tap.Flush(); err != nil {
			t.Fatal(err)
		}
		for {
			if _, err := sub.NextMsg(0); err != nil {
				break
			}
		}
		if err := g.r.nc.ForceReconnect(); err != nil {
			t.Fatalf("ForceReconnect: %v", err)
		}
		g.releases(t)
		if err := tap.Flush(); err != nil {
			t.Fatal(err)
		}
		next, err := sub.NextMsg(time.Second)
		if err != nil {
			t.Fatalf("round %d: nothing published on lease.0 after the lost renewal, want the release's delete: %v", round, err)
		}
		if op := next.Header.Get("KV-Operation"); op == "DEL" || op == "PURGE" {
			t.Logf("round %d: the release (%s) came before the next renewal", round, op)
			return
		}
		if round == 3 {
			t.Fatalf("in %d rounds the next renewal came before the release: the release with the lost answer was never tested", round)
		}
		t.Logf("round %d: the next renewal came before the release; again", round)
	}
}

// TestSameIDWriterIsNotAdopted overwrites a held lease with the holder's own replica id, as
// another process started with the same id would after claiming it: the holder's next renewal
// conflicts, the stored lease names its id but not its claim, and the holder must give the
// partition up rather than adopt the stranger's revision.
func TestSameIDWriterIsNotAdopted(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	tr := newTracker(t)
	r := startReplica(t, srv, "a", 1, tr.work("a"))
	natstest.Eventually(t, 5*time.Second, ownedEquals(r, []int{0}))
	natstest.Eventually(t, 5*time.Second, func() error {
		ent, err := kv.Get(context.Background(), "lease.0")
		if err != nil {
			return fmt.Errorf("Get(lease.0): %w", err)
		}
		// A renewal may land between the Get and the Update: then try again.
		_, err = kv.Update(context.Background(), "lease.0", []byte("a"), ent.Revision())
		return err
	})
	select {
	case e := <-tr.ends:
		if !errors.Is(e.cause, election.ErrLeaseLost) {
			t.Errorf("Work cause = %v, want ErrLeaseLost", e.cause)
		}
	case <-time.After(3 * ttl):
		t.Fatalf("Work still running %v after another writer took lease.0 under the same id", 3*ttl)
	}
}

// TestUnreadableLeaseAfterAConflictIsNotLost has the holder's renewal conflict with a renewal of
// its own claim that it did not make itself (as a renewal whose answer was lost), while the
// holder cannot read the lease back: it must not take that for a lost lease, and must adopt the
// renewal once it can read it, within its lease clock.
func TestUnreadableLeaseAfterAConflictIsNotLost(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	drop := &natstest.Dropper{}
	nc, rjs := srv.JetStream(t, nats.SetCustomDialer(drop))
	leases := make(chan *election.Lease, 1)
	ends := make(chan error, 1)
	r := runReplica(t, nc, rjs, "a", 1, func(ctx context.Context, l *election.Lease) error {
		leases <- l
		<-ctx.Done()
		ends <- context.Cause(ctx)
		return nil
	}, func(c *election.Config) { c.LeaseTTL = gatedTTL })
	var l *election.Lease
	select {
	case l = <-leases:
	case <-time.After(10 * time.Second):
		t.Fatalf("partition 0 not claimed within 10s")
	}

	drop.Drop("$JS.API.STREAM.MSG.GET.")
	ctx := context.Background()
	var injected uint64
	natstest.Eventually(t, 5*time.Second, func() error {
		ent, err := kv.Get(ctx, "lease.0")
		if err != nil {
			return err
		}
		m := nats.NewMsg("$KV." + bucket + ".lease.0")
		m.Data = []byte("a")
		m.Header.Set("Kvmapper-Lease-Epoch", strconv.FormatUint(l.Epoch, 10))
		// A renewal may land between the Get and this write: then try again.
		ack, err := js.PublishMsg(ctx, m, jetstream.WithMsgTTL(gatedTTL), jetstream.WithExpectLastSequencePerSubject(ent.Revision()))
		if err != nil {
			return err
		}
		injected = ack.Sequence
		return nil
	})
	natstest.Eventually(t, 2*gatedTTL, func() error {
		if drop.Dropped() == 0 {
			return errors.New("the holder has not tried to read the lease back yet")
		}
		return nil
	})
	drop.Drop("")
	natstest.Eventually(t, 2*gatedTTL, func() error {
		select {
		case cause := <-ends:
			t.Fatalf("Work ended with cause %v after an unreadable conflict, want partition 0 kept", cause)
		default:
		}
		ent, err := kv.Get(ctx, "lease.0")
		if err != nil {
			return err
		}
		if ent.Revision() <= injected {
			return fmt.Errorf("lease.0 at revision %d, want a renewal after the one at %d", ent.Revision(), injected)
		}
		return nil
	})
	if !l.Valid() || !slices.Equal(r.e.Owned(), []int{0}) {
		t.Errorf("Valid() = %v, Owned() = %v; want the lease kept", l.Valid(), r.e.Owned())
	}
	t.Logf("%d reads of the lease dropped; renewal of revision %d adopted", drop.Dropped(), injected)
}
