package election_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

const (
	bucket = "kvmapper"
	ttl    = time.Second
)

// newBucket creates the control bucket as setup would.
func newBucket(t *testing.T, js jetstream.JetStream) jetstream.KeyValue {
	t.Helper()
	kv, err := js.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: bucket, LimitMarkerTTL: time.Second, History: 1})
	if err != nil {
		t.Fatalf("CreateKeyValue: %v", err)
	}
	return kv
}

// tracker records Work runs across electors and fails the test when two replicas run the same
// partition at the same time.
type tracker struct {
	t      *testing.T
	mu     sync.Mutex
	owner  map[int]string
	epoch  map[int]uint64 // epoch of the Work last started per partition
	starts map[int]int
	ends   chan end
}

type end struct {
	replica   string
	partition int
	cause     error
	at        time.Time
}

func newTracker(t *testing.T) *tracker {
	return &tracker{t: t, owner: map[int]string{}, epoch: map[int]uint64{}, starts: map[int]int{}, ends: make(chan end, 1024)}
}

func (tr *tracker) work(id string) election.Work {
	return func(ctx context.Context, l *election.Lease) error {
		tr.mu.Lock()
		if o, ok := tr.owner[l.Partition]; ok {
			tr.t.Errorf("partition %d run by %s while %s still runs it", l.Partition, id, o)
		}
		if !l.Valid() {
			tr.t.Errorf("partition %d: Work started with an invalid lease", l.Partition)
		}
		tr.owner[l.Partition] = id
		tr.epoch[l.Partition] = l.Epoch
		tr.starts[l.Partition]++
		tr.mu.Unlock()
		<-ctx.Done()
		tr.mu.Lock()
		if tr.owner[l.Partition] == id {
			delete(tr.owner, l.Partition)
		}
		tr.mu.Unlock()
		tr.ends <- end{replica: id, partition: l.Partition, cause: context.Cause(ctx), at: time.Now()}
		return nil
	}
}

// replica is one running Elector with its own connection.
type replica struct {
	id     string
	e      *election.Elector
	nc     *nats.Conn
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

func startReplica(t *testing.T, srv *natstest.Server, id string, partitions int, work election.Work, mods ...func(*election.Config)) *replica {
	t.Helper()
	nc, js := srv.JetStream(t)
	return runReplica(t, nc, js, id, partitions, work, mods...)
}

// runReplica runs an Elector on the connection the caller made.
func runReplica(t *testing.T, nc *nats.Conn, js jetstream.JetStream, id string, partitions int, work election.Work, mods ...func(*election.Config)) *replica {
	t.Helper()
	kv, err := js.KeyValue(context.Background(), bucket)
	if err != nil {
		t.Fatalf("KeyValue(%s): %v", bucket, err)
	}
	cfg := election.Config{
		ReplicaID:  id,
		Partitions: partitions,
		LeaseTTL:   ttl,
		Logger:     zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel),
	}
	for _, m := range mods {
		m(&cfg)
	}
	e, err := election.New(js, kv, work, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{id: id, e: e, nc: nc, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- e.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels Run and waits for it to return.
func (r *replica) stop(t *testing.T) error {
	t.Helper()
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(15 * time.Second):
			t.Fatalf("%s: Run did not return within 15s of cancel", r.id)
		}
	})
	return r.err
}

func all(n int) []int {
	ps := make([]int, n)
	for i := range ps {
		ps[i] = i
	}
	return ps
}

// planned returns the partitions Plan has id claim (free) or release (owner) when members are
// live and owner holds every partition, or all are free when owner is "".
func planned(partitions int, id string, members []string, owner string) []int {
	owners := slices.Repeat([]string{owner}, partitions)
	claim, release := election.Plan(id, members, owners)
	return slices.Sorted(slices.Values(append(claim, release...)))
}

// ownsCount returns a check, for natstest.Eventually, that r owns lo to hi partitions.
func ownsCount(r *replica, lo, hi int) func() error {
	return func() error {
		if got := r.e.Owned(); len(got) < lo || len(got) > hi {
			return fmt.Errorf("%s.Owned() = %v, want %d…%d partitions", r.id, got, lo, hi)
		}
		return nil
	}
}

func ownedEquals(r *replica, want []int) func() error {
	return func() error {
		if got := r.e.Owned(); !slices.Equal(got, want) {
			return fmt.Errorf("%s.Owned() = %v, want %v", r.id, got, want)
		}
		return nil
	}
}

func keyGone(t *testing.T, kv jetstream.KeyValue, key string) error {
	_, err := kv.Get(context.Background(), key)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		return nil
	}
	if err != nil {
		t.Fatalf("Get(%s): %v", key, err)
	}
	return fmt.Errorf("key %s still present", key)
}

func TestNewInvalidConfig(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	work := func(ctx context.Context, _ *election.Lease) error { <-ctx.Done(); return nil }
	tests := []struct {
		name string
		cfg  election.Config
	}{
		{"no id", election.Config{Partitions: 1}},
		{"wildcard id", election.Config{ReplicaID: "a.*", Partitions: 1}},
		{"no partitions", election.Config{ReplicaID: "a"}},
		{"fractional ttl", election.Config{ReplicaID: "a", Partitions: 1, LeaseTTL: 1500 * time.Millisecond}},
		{"sub-second ttl", election.Config{ReplicaID: "a", Partitions: 1, LeaseTTL: 500 * time.Millisecond}},
		{"margin too large", election.Config{ReplicaID: "a", Partitions: 1, LeaseTTL: time.Second, Margin: 800 * time.Millisecond}},
		{"renew ≥ ttl", election.Config{ReplicaID: "a", Partitions: 1, LeaseTTL: time.Second, RenewInterval: time.Second}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := election.New(js, kv, work, tt.cfg); !errors.Is(err, election.ErrInvalidConfig) {
				t.Fatalf("New(%+v) = %v, want ErrInvalidConfig", tt.cfg, err)
			}
		})
	}
	if _, err := election.New(js, kv, work, election.Config{ReplicaID: "host.example-1", Partitions: 16}); err != nil {
		t.Fatalf("New(valid) = %v, want nil", err)
	}
}

func TestRunRefusesBucketWithoutMarkers(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv, err := js.CreateKeyValue(context.Background(), jetstream.KeyValueConfig{Bucket: "plain"})
	if err != nil {
		t.Fatalf("CreateKeyValue: %v", err)
	}
	e, err := election.New(js, kv, func(context.Context, *election.Lease) error { return nil }, election.Config{ReplicaID: "a", Partitions: 1})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := e.Run(context.Background()); !errors.Is(err, election.ErrInvalidConfig) {
		t.Fatalf("Run() = %v, want ErrInvalidConfig", err)
	}
}

func TestSingleElectorClaimsAllAndReleases(t *testing.T) {
	t.Parallel()
	const P = 8
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	tr := newTracker(t)
	r := startReplica(t, srv, "solo", P, tr.work("solo"))
	natstest.Eventually(t, 5*time.Second, ownedEquals(r, all(P)))

	if err := r.stop(t); err != nil {
		t.Fatalf("Run() = %v, want nil", err)
	}
	for range P {
		select {
		case e := <-tr.ends:
			if !errors.Is(e.cause, election.ErrReleased) {
				t.Errorf("partition %d: Work cause = %v, want ErrReleased", e.partition, e.cause)
			}
		default:
			t.Fatalf("Run returned before every Work did")
		}
	}
	for p, n := range tr.starts {
		if n != 1 {
			t.Errorf("partition %d: Work started %d times, want 1", p, n)
		}
	}
	if got := r.e.Owned(); len(got) != 0 {
		t.Errorf("Owned() after Run = %v, want []", got)
	}
	for p := range P {
		if err := keyGone(t, kv, fmt.Sprintf("lease.%d", p)); err != nil {
			t.Error(err)
		}
	}
	if err := keyGone(t, kv, "member.solo"); err != nil {
		t.Error(err)
	}
}

// TestRenewKeepsLease checks that a renewed lease outlives its TTL many times over with the same
// epoch and growing revisions.
func TestRenewKeepsLease(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	leases := make(chan *election.Lease, 1)
	r := startReplica(t, srv, "a", 1, func(ctx context.Context, l *election.Lease) error {
		leases <- l
		<-ctx.Done()
		return nil
	})
	var l *election.Lease
	select {
	case l = <-leases:
	case <-time.After(10 * time.Second):
		t.Fatalf("no lease granted within 10s")
	}
	w, err := kv.Watch(context.Background(), "lease.0")
	if err != nil {
		t.Fatalf("Watch: %v", err)
	}
	defer w.Stop()
	var last uint64
	renewals := 0
	deadline := time.After(4 * ttl)
	for watching := true; watching; {
		select {
		case ent := <-w.Updates():
			if ent == nil {
				continue
			}
			if ent.Operation() != jetstream.KeyValuePut {
				t.Fatalf("lease.0 %v at revision %d while renewed", ent.Operation(), ent.Revision())
			}
			if ent.Revision() <= last {
				t.Fatalf("lease.0 revision %d after %d, want growing", ent.Revision(), last)
			}
			last = ent.Revision()
			renewals++
		case <-deadline:
			watching = false
		}
	}
	if renewals < 8 {
		t.Errorf("saw %d renewals in 4 TTLs, want ≥ 8", renewals)
	}
	if !l.Valid() {
		t.Errorf("Lease.Valid() = false while renewed")
	}
	if got := r.e.Owned(); !slices.Equal(got, []int{0}) {
		t.Errorf("Owned() = %v, want [0]", got)
	}
	if l.Epoch >= last {
		t.Errorf("Epoch = %d, latest revision %d: want the epoch to stay the claim revision", l.Epoch, last)
	}
}

// TestKillFailover closes one replica's connection without releasing: its Works end by
// self-fencing with ErrLeaseLost, the lease expires on the server, and the other replica takes
// over within TTL plus about a second.
func TestKillFailover(t *testing.T) {
	t.Parallel()
	const P = 8
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	kv := newBucket(t, js)
	tr := newTracker(t)
	a := startReplica(t, srv, "a", P, tr.work("a"))
	b := startReplica(t, srv, "b", P, tr.work("b"))
	natstest.Eventually(t, 10*time.Second, ownsCount(a, P/2, P/2))
	natstest.Eventually(t, 10*time.Second, ownsCount(b, P/2, P/2))
	lost := a.e.Owned()

	for drained := false; !drained; { // Work ends from the start-up rebalance
		select {
		case <-tr.ends:
		default:
			drained = true
		}
	}
	w, err := kv.Watch(context.Background(), "lease.*", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatalf("Watch: %v", err)
	}
	defer w.Stop()
	// Only the leases a still holds once the watch runs are measured: under the race detector
	// a's renewal can miss its 1 s TTL before the kill, and b may then take that lease before the
	// watch sees its expiry (the expiry unseen, the claim would never count).
	held := lost[:0:0]
	for _, p := range lost {
		if e, err := kv.Get(context.Background(), fmt.Sprintf("lease.%d", p)); err == nil && string(e.Value()) == "a" {
			held = append(held, p)
		}
	}
	if len(held) < len(lost) {
		t.Logf("a held %v of %v when the watch started", held, lost)
	}
	if len(held) == 0 {
		t.Fatal("a held no lease when the watch started: the test proves nothing")
	}

	killed := time.Now()
	a.nc.Close()

	// a's Works end by self-fencing, before the lease could expire on the server.
	ended := map[int]bool{}
	endBy := time.NewTimer(10 * time.Second)
	defer endBy.Stop()
	for len(ended) < len(held) {
		var e end
		select {
		case e = <-tr.ends:
		case <-endBy.C:
			t.Fatalf("a's Works of %v did not all end within 10s of the kill: ended %v", held, ended)
		}
		if e.replica != "a" || !errors.Is(e.cause, election.ErrLeaseLost) {
			t.Fatalf("Work end %+v, want replica a with ErrLeaseLost", e)
		}
		if !slices.Contains(held, e.partition) {
			continue // a lease a lost before the watch started
		}
		ended[e.partition] = true
		if d := e.at.Sub(killed); d > ttl {
			t.Errorf("partition %d fenced %v after the kill, want ≤ TTL %v", e.partition, d, ttl)
		}
	}
	fenced := time.Since(killed)

	expired := map[string]time.Time{}
	claimed := map[string]time.Time{}
	// One deadline for them all: b's renewals keep the watch busy, so a wait per update would
	// never end if a lease's expiry or claim were missed (a CI run hung here for 11 minutes).
	timeout := time.NewTimer(ttl + 5*time.Second)
	defer timeout.Stop()
	for len(claimed) < len(held) {
		select {
		case ent := <-w.Updates():
			if ent == nil {
				continue
			}
			switch {
			case ent.Operation() == jetstream.KeyValuePurge:
				expired[ent.Key()] = time.Now()
			case ent.Operation() == jetstream.KeyValuePut && string(ent.Value()) == "b" && isLeaseOf(ent.Key(), held):
				if _, ok := claimed[ent.Key()]; !ok && !expired[ent.Key()].IsZero() {
					claimed[ent.Key()] = time.Now()
				}
			}
		case <-timeout.C:
			t.Fatalf("after %v: expired %v, claimed by b %v; want a's %v each expired, then claimed by b", time.Since(killed), expired, claimed, held)
		}
	}
	var worst, worstGap time.Duration
	for k, at := range claimed {
		worst = max(worst, at.Sub(killed))
		worstGap = max(worstGap, at.Sub(expired[k]))
	}
	t.Logf("kill → all Works fenced %v; kill → last takeover %v; expiry marker → claim ≤ %v", fenced, worst, worstGap)
	if worst > ttl+time.Second {
		t.Errorf("takeover took %v after the kill, want ≤ TTL + 1s", worst)
	}
	natstest.Eventually(t, 5*time.Second, ownedEquals(b, all(P)))
	if err := a.stop(t); err != nil {
		t.Errorf("killed replica's Run() = %v, want nil", err)
	}
}

// isLeaseOf reports whether key is the lease key of one of partitions.
func isLeaseOf(key string, partitions []int) bool {
	return slices.ContainsFunc(partitions, func(p int) bool { return key == fmt.Sprintf("lease.%d", p) })
}
