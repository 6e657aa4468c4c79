package election_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// TestStalledWatchIsReplaced runs the control bucket on a 3-node cluster (R3) with replica a
// connected to the bucket's leader and its watch (an R1 consumer, which the servers place on
// any of the stream's replicas) on a follower F, and replica b connected to F. Then F loses
// every route: b falls silent, and a's writes go on being stored by the leader and the third
// node, but a's watch shows none of them (its consumer is on F). a must notice that its own
// writes do not come back, start a new watch, and take b's partitions over after JudgedExpiry
// of writable time on it — well before the 10s lease TTL. Without the check a counts no
// writable time at all, and b's partitions wait for the TTL (and a's frozen watch beyond).
func TestStalledWatchIsReplaced(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	const P = 4
	c := natstest.StartCluster(t, 3)
	admin := c.Connect(t, 0)
	js, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, LimitMarkerTTL: time.Second, History: 1, Replicas: 3}); err != nil {
		t.Fatalf("CreateKeyValue: %v", err)
	}
	stream := "KV_" + bucket
	c.WaitStreamCurrent(stream, 30*time.Second)
	l := c.WaitStreamLeader(stream, -1, 30*time.Second)
	f := (l + 1) % 3
	c.MoveMetaLeaderOff(f)
	rs := newRuns()

	// Start a on the leader until its watch's consumer lands on F (a third of the tries).
	var a *replica
	var watch string // a's watch consumer
	seen := map[string]bool{}
	for try := 1; a == nil; try++ {
		if try > 30 {
			t.Fatalf("a's watch never placed on %s in 30 starts", c.Name(f))
		}
		anc := c.Connect(t, l)
		ajs, err := jetstream.New(anc)
		if err != nil {
			t.Fatal(err)
		}
		r := runReplica(t, anc, ajs, "a", P, rs.work("a"), judgedConfig)
		var on string
		natstest.Eventually(t, 10*time.Second, func() error {
			var err error
			watch, on, err = newConsumer(js, stream, seen)
			return err
		})
		if on == c.Name(f) {
			a = r
			t.Logf("try %d: a's watch is on %s, a follower of the bucket's leader %s", try, on, c.Name(l))
			break
		}
		if err := r.stop(t); err != nil {
			t.Fatalf("stopping a: %v", err)
		}
	}
	bnc := c.Connect(t, f)
	bjs, err := jetstream.New(bnc)
	if err != nil {
		t.Fatal(err)
	}
	b := runReplica(t, bnc, bjs, "b", P, rs.work("b"), judgedConfig)
	natstest.Eventually(t, 20*time.Second, ownsCount(a, P/2, P/2))
	natstest.Eventually(t, 20*time.Second, ownsCount(b, P/2, P/2))
	if on, err := watchHost(js, stream, watch, a); err != nil || on != c.Name(f) {
		t.Fatalf("a's watch is on %q (%v) before the cut, want %s", on, err, c.Name(f))
	}
	theirs := b.e.Owned()

	c.CutRoutes(f)
	cut := time.Now()
	natstest.Eventually(t, judgedTTL, ownsCount(a, P, P))
	took := time.Since(cut)
	t.Logf("a took b's partitions %v over %v after %s lost its routes; a replaced its watch %d times", theirs, took.Round(time.Millisecond), c.Name(f), a.e.WatchStalls())
	if a.e.WatchStalls() == 0 {
		t.Errorf("a took b's partitions over without replacing its watch: the watch was not stalled, the test proved nothing")
	}
	// JudgedExpiry (1s) after a new watch, which comes an ownGap (0.75s) after the cut, and
	// another ownGap later for each creation the servers placed on F again (a third of them):
	// about 2.2s, 3.2s, 4.2s… The lease TTL is 10s.
	if bound := judgedTTL * 8 / 10; took > bound {
		t.Errorf("b's partitions taken over %v after the cut, want within %v (a stalled watch replaced, then JudgedExpiry %v; the lease TTL is %v)", took, bound, judgedAfter, judgedTTL)
	}
	for _, p := range theirs {
		if r := rs.last(p); r.replica != "a" || r.at.Before(cut) {
			t.Errorf("partition %d: last run by %s at %v, want a after the cut", p, r.replica, r.at)
		}
	}
}

// newConsumer returns the name and server of the one consumer of stream not in seen, adding it
// to seen; an error while there is none, or more than one.
func newConsumer(js jetstream.JetStream, stream string, seen map[string]bool) (name, host string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return "", "", err
	}
	var fresh []*jetstream.ConsumerInfo
	l := s.ListConsumers(ctx)
	for ci := range l.Info() {
		if !seen[ci.Name] {
			fresh = append(fresh, ci)
		}
	}
	if err := l.Err(); err != nil {
		return "", "", err
	}
	if len(fresh) != 1 || fresh[0].Cluster == nil || fresh[0].Cluster.Leader == "" {
		return "", "", fmt.Errorf("%d new consumers on %s, want one with a leader", len(fresh), stream)
	}
	seen[fresh[0].Name] = true
	return fresh[0].Name, fresh[0].Cluster.Leader, nil
}

// watchHost returns the server of a's watch consumer, which must still exist: a has not
// replaced its watch.
func watchHost(js jetstream.JetStream, stream, watch string, a *replica) (string, error) {
	if n := a.e.WatchStalls(); n != 0 {
		return "", fmt.Errorf("a replaced its watch %d times before the cut", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return "", err
	}
	// A push consumer: Stream.Consumer refuses it. The listing is read to its end (stopping
	// early leaves its goroutine blocked).
	host := ""
	l := s.ListConsumers(ctx)
	for ci := range l.Info() {
		if ci.Name == watch && ci.Cluster != nil {
			host = ci.Cluster.Leader
		}
	}
	if err := l.Err(); err != nil {
		return "", err
	}
	if host == "" {
		return "", fmt.Errorf("a's watch consumer %s is gone", watch)
	}
	return host, nil
}
