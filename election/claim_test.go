package election_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// answerLoser is a nats.CustomDialer whose connections lose the answer to one request that the
// server applies, and nothing else: once armed, the first publish whose protocol line contains
// match has its reply subject noted before it goes out, and the one message the server sends to
// that subject is left out of what the connection reads. The connection stays up, so the
// request times out, or fails with ErrDisconnected if the connection is closed meanwhile. It
// also drops outgoing publishes as its [natstest.Dropper] says. It is safe for concurrent use.
type answerLoser struct {
	natstest.Dropper
	match []byte

	mu      sync.Mutex
	armed   bool
	reply   []byte        // the subject of the answer to lose; nil once lost or before the trip
	tripped chan struct{} // closed when the armed loser notes the request
	lost    chan struct{} // closed when the answer has been left out
}

func newAnswerLoser(match string) *answerLoser {
	return &answerLoser{match: []byte(match), tripped: make(chan struct{}), lost: make(chan struct{})}
}

// arm makes the next publish whose protocol line contains match lose its answer.
func (a *answerLoser) arm() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.armed = true
}

// Dial implements nats.CustomDialer.
func (a *answerLoser) Dial(network, address string) (net.Conn, error) {
	c, err := a.Dropper.Dial(network, address)
	if err != nil {
		return nil, err
	}
	return &losingConn{Conn: c, a: a, buf: make([]byte, 32<<10)}, nil
}

// wrote notes the reply subject of the publish in b that contains match, if armed.
func (a *answerLoser) wrote(b []byte) {
	a.mu.Lock()
	defer a.mu.Unlock()
	i := bytes.Index(b, a.match)
	if !a.armed || i < 0 {
		return
	}
	start := bytes.LastIndexByte(b[:i], '\n') + 1
	end := bytes.IndexByte(b[i:], '\r')
	if end < 0 {
		return // a line cut in two writes; nats.go writes whole lines
	}
	// PUB <subject> <reply> <size> or HPUB <subject> <reply> <header size> <total size>.
	f := bytes.Fields(b[start : i+end])
	if len(f) < 4 || !bytes.Equal(f[1], bytes.TrimSpace(a.match)) {
		return
	}
	a.armed = false
	a.reply = bytes.Clone(f[2])
	close(a.tripped)
}

// loses reports whether the message to subject is the answer to lose.
func (a *answerLoser) loses(subject []byte) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.reply == nil || !bytes.Equal(subject, a.reply) {
		return false
	}
	a.reply = nil
	close(a.lost)
	return true
}

// losingConn parses what the server sends, protocol line by protocol line, and leaves out the
// message its answerLoser loses. nats.go reads from one goroutine.
type losingConn struct {
	net.Conn
	a    *answerLoser
	buf  []byte
	out  []byte // filtered bytes not returned yet
	err  error  // the read error to return once out is empty
	line []byte // a protocol line not complete yet
	left int    // payload bytes (with their CRLF) of the current message still to come
	drop bool   // the current message is left out
}

func (c *losingConn) Write(b []byte) (int, error) {
	c.a.wrote(b)
	return c.Conn.Write(b)
}

func (c *losingConn) Read(b []byte) (int, error) {
	for len(c.out) == 0 {
		if c.err != nil {
			return 0, c.err
		}
		n, err := c.Conn.Read(c.buf)
		c.filter(c.buf[:n])
		c.err = err
	}
	n := copy(b, c.out)
	c.out = c.out[n:]
	return n, nil
}

// filter appends to out what p holds but the message to lose.
func (c *losingConn) filter(p []byte) {
	for len(p) > 0 {
		if c.left > 0 {
			k := min(c.left, len(p))
			if !c.drop {
				c.out = append(c.out, p[:k]...)
			}
			p, c.left = p[k:], c.left-k
			continue
		}
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			c.line = append(c.line, p...)
			return
		}
		line := append(c.line, p[:i+1]...)
		c.line = nil
		p = p[i+1:]
		c.drop = false
		// MSG <subject> <sid> [reply] <size> and HMSG <subject> <sid> [reply] <header size>
		// <total size>: the last field is what follows the line, before its CRLF.
		if f := bytes.Fields(line); len(f) >= 4 {
			switch string(f[0]) {
			case "MSG", "HMSG":
				if size, err := strconv.Atoi(string(f[len(f)-1])); err == nil {
					c.left = size + 2
					c.drop = c.a.loses(f[1])
				}
			}
		}
		if !c.drop {
			c.out = append(c.out, line...)
		}
	}
}

// losingClaim is replica "a" electing the single partition 0 on a connection through an
// answerLoser armed before it starts, so that the answer to its first claim is lost.
type losingClaim struct {
	ttl    time.Duration // the lease TTL
	loser  *answerLoser
	kv     jetstream.KeyValue // the test's own view of the bucket
	r      *replica
	leases chan *election.Lease // each Work's lease, as it starts
	ends   chan error           // the cause of each Work's context, as it returns
}

// startLosingClaim starts the replica with lease TTL ttl and mods; dropReads makes its
// connection drop every read of the lease from the bucket's leader until Drop("") is called.
func startLosingClaim(t *testing.T, ttl time.Duration, dropReads bool, mods ...func(*election.Config)) *losingClaim {
	t.Helper()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	lc := &losingClaim{
		ttl:    ttl,
		loser:  newAnswerLoser(" $KV." + bucket + ".lease.0 "),
		kv:     newBucket(t, js),
		leases: make(chan *election.Lease, 4),
		ends:   make(chan error, 4),
	}
	lc.loser.arm()
	if dropReads {
		lc.loser.Drop("$JS.API.STREAM.MSG.GET.")
	}
	nc, rjs := srv.JetStream(t, nats.SetCustomDialer(lc.loser))
	mods = append([]func(*election.Config){func(c *election.Config) { c.LeaseTTL = ttl }}, mods...)
	lc.r = runReplica(t, nc, rjs, "a", 1, func(ctx context.Context, l *election.Lease) error {
		lc.leases <- l
		<-ctx.Done()
		lc.ends <- context.Cause(ctx)
		return nil
	}, mods...)
	return lc
}

// stored waits until the claim whose answer is lost is stored, and returns its revision and when
// the test saw it.
func (lc *losingClaim) stored(t *testing.T) (uint64, time.Time) {
	t.Helper()
	select {
	case <-lc.loser.tripped:
	case <-time.After(10 * time.Second):
		t.Fatalf("no claim of lease.0 sent within 10s")
	}
	var rev uint64
	natstest.Eventually(t, 2*time.Second, func() error {
		ent, err := lc.kv.Get(context.Background(), "lease.0")
		if err != nil {
			return fmt.Errorf("Get(lease.0): %w", err)
		}
		if string(ent.Value()) != "a" {
			return fmt.Errorf("lease.0 = %q, want a's claim", ent.Value())
		}
		rev = ent.Revision()
		return nil
	})
	return rev, time.Now()
}

// ownedUnder waits for the first Work and checks that it runs under the claim stored at epoch,
// which it started before that claim's TTL could have run out.
func (lc *losingClaim) ownedUnder(t *testing.T, epoch uint64, storedAt time.Time) *election.Lease {
	t.Helper()
	select {
	case l := <-lc.leases:
		after := time.Since(storedAt)
		if l.Epoch != epoch {
			t.Fatalf("Work started %v after the claim was stored, under epoch %d; want the claim whose answer was lost (epoch %d) taken at once, not a new claim after its TTL (%v)",
				after, l.Epoch, epoch, lc.ttl)
		}
		if after >= lc.ttl {
			t.Errorf("Work started %v after the claim was stored, want it within the lease TTL %v", after, lc.ttl)
		}
		t.Logf("claim stored at revision %d, its answer lost; partition owned under it %v later", epoch, after)
		return l
	case <-time.After(3 * lc.ttl):
		t.Fatalf("partition 0 not owned within %v of its claim", 3*lc.ttl)
	}
	return nil
}

// renewsAndReleases checks that the holder renews the lease it took (a compare-and-set on the
// claim's revision) and that stopping the replica releases the partition and deletes the lease.
func (lc *losingClaim) renewsAndReleases(t *testing.T, l *election.Lease) {
	t.Helper()
	natstest.Eventually(t, 2*lc.ttl, func() error {
		select {
		case cause := <-lc.ends:
			t.Fatalf("Work ended with cause %v, want partition 0 kept", cause)
		default:
		}
		ent, err := lc.kv.Get(context.Background(), "lease.0")
		if err != nil {
			return fmt.Errorf("Get(lease.0): %w", err)
		}
		if ent.Revision() <= l.Epoch || string(ent.Value()) != "a" {
			return fmt.Errorf("lease.0 = %q at revision %d, want a renewal by a after the claim at %d", ent.Value(), ent.Revision(), l.Epoch)
		}
		return nil
	})
	if !l.Valid() {
		t.Errorf("Lease.Valid() = false after a renewal, want the lease kept")
	}
	if err := lc.r.stop(t); err != nil {
		t.Errorf("Run() = %v, want nil", err)
	}
	select {
	case cause := <-lc.ends:
		if !errors.Is(cause, election.ErrReleased) {
			t.Errorf("Work cause = %v, want ErrReleased", cause)
		}
	default:
		t.Errorf("Run returned before Work did")
	}
	if err := keyGone(t, lc.kv, "lease.0"); err != nil {
		t.Errorf("after Run returned: %v, want the released lease deleted", err)
	}
}

// TestClaimAnswerTimedOut has the server store a claim whose answer never reaches the claimer,
// which gives up waiting for it: the claimer must read the lease back, recognise its own claim
// and own the partition at once, not leave the lease to expire unserved.
func TestClaimAnswerTimedOut(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	lc := startLosingClaim(t, gatedTTL, false)
	rev, at := lc.stored(t)
	l := lc.ownedUnder(t, rev, at)
	lc.renewsAndReleases(t, l)
}

// TestClaimAnswerLostInReconnect is TestClaimAnswerTimedOut with the answer lost in a reconnect:
// nats.go fails the pending claim with ErrDisconnected.
func TestClaimAnswerLostInReconnect(t *testing.T) {
	t.Parallel()
	lc := startLosingClaim(t, gatedTTL, false)
	rev, at := lc.stored(t)
	if err := lc.r.nc.ForceReconnect(); err != nil {
		t.Fatalf("ForceReconnect: %v", err)
	}
	l := lc.ownedUnder(t, rev, at)
	lc.renewsAndReleases(t, l)
}

// TestClaimAnswerLostAndLeaseUnreadable loses a claim's answer while the claimer cannot read the
// lease back either (as from a bucket electing its leader): it must try again while the claim's
// lease clock runs, and own the partition under that claim as soon as it can read it.
func TestClaimAnswerLostAndLeaseUnreadable(t *testing.T) {
	t.Parallel()
	lc := startLosingClaim(t, gatedTTL, true, func(c *election.Config) { c.RenewInterval = 500 * time.Millisecond })
	rev, at := lc.stored(t)
	natstest.Eventually(t, gatedTTL, func() error {
		if lc.loser.Dropped() == 0 {
			return errors.New("the claimer has not tried to read the lease back yet")
		}
		return nil
	})
	lc.loser.Drop("")
	l := lc.ownedUnder(t, rev, at)
	lc.renewsAndReleases(t, l)
}

// TestClaimOfTheSameIDIsNotTaken loses a claim's answer and, before the claimer can read the
// lease back, replaces its claim with one under the same replica id, as another process started
// with that id (or a kvmapper older than claim nonces) would make: the stored lease names the
// claimer but not its claim, and the claimer must leave it alone until it expires.
func TestClaimOfTheSameIDIsNotTaken(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	lc := startLosingClaim(t, gatedTTL, true, func(c *election.Config) { c.RenewInterval = 500 * time.Millisecond })
	rev, _ := lc.stored(t)
	natstest.Eventually(t, gatedTTL, func() error {
		if lc.loser.Dropped() == 0 {
			return errors.New("the claimer has not tried to read the lease back yet")
		}
		return nil
	})
	ctx := context.Background()
	if err := lc.kv.Delete(ctx, "lease.0", jetstream.LastRevision(rev)); err != nil {
		t.Fatalf("Delete(lease.0 at %d): %v", rev, err)
	}
	stranger, err := lc.kv.Create(ctx, "lease.0", []byte("a"), jetstream.KeyTTL(gatedTTL))
	if err != nil {
		t.Fatalf("Create(lease.0): %v", err)
	}
	lc.loser.Drop("")
	select {
	case l := <-lc.leases:
		if l.Epoch <= stranger {
			t.Fatalf("Work started under epoch %d, want neither the lost claim (%d) nor the stranger's (%d): a claim after the stranger's lease expired",
				l.Epoch, rev, stranger)
		}
		t.Logf("lost claim at %d, the stranger's at %d; partition claimed anew at %d", rev, stranger, l.Epoch)
	case <-time.After(4 * gatedTTL):
		t.Fatalf("partition 0 not owned within %v of the stranger's claim", 4*gatedTTL)
	}
}

// TestClaimFoundLateIsRenewedAtOnce has a claim whose answer is lost found stored only by a later
// attempt, with less of its lease clock left than a renewal interval (RenewInterval 1.5s, and the
// claim found after three of them: its own wait, the failed read back, the wait before trying
// again, of a TTL of 6s less a margin of 400ms): the claimer must renew it at once, or the
// lease runs out before its first renewal is due.
func TestClaimFoundLateIsRenewedAtOnce(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	const ttl = 6 * time.Second
	lc := startLosingClaim(t, ttl, true, func(c *election.Config) { c.RenewInterval = 1500 * time.Millisecond })
	rev, at := lc.stored(t)
	natstest.Eventually(t, ttl, func() error {
		if lc.loser.Dropped() == 0 {
			return errors.New("the claimer has not tried to read the lease back yet")
		}
		return nil
	})
	lc.loser.Drop("")
	l := lc.ownedUnder(t, rev, at)
	lc.renewsAndReleases(t, l)
}
