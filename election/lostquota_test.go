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

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/wire"
)

// A partition whose lease a replica lost, while its Work is still returning (a fenced lane
// drains its publishes for up to 10 s), is not the replica's share any more. A replica back from
// a network cut lost five that way in a clean-clone CI run (2026-12-07), counted them in its
// quota while they drained, claimed nothing the others handed it, and the others claimed its
// share again after Grace and kept it for 5 lease TTLs. Here replica a holds both partitions,
// loses the one it would keep to an intruder whose lease then expires, and that partition's
// Work does not return; b joins: a must keep the other one (it is a's whole quota, not a
// surplus to hand over) and b, under its quota, must get the freed one, which a may not claim
// again before its Work returned.
func TestLostLeaseStillReturningIsNotCountedInTheQuota(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)

	// keep is the partition a hands over first when over its quota (the lowest weight for a);
	// lost is the other.
	_, over := election.Plan("a", []string{"a", "b"}, []string{"a", "a"})
	keep := over[0]
	lost := 1 - keep

	var mu sync.Mutex
	ended := map[int]error{}
	drained := make(chan struct{})
	work := func(ctx context.Context, l *election.Lease) error {
		<-ctx.Done()
		cause := context.Cause(ctx)
		mu.Lock()
		ended[l.Partition] = cause
		mu.Unlock()
		if errors.Is(cause, election.ErrLeaseLost) {
			<-drained // still returning when b joins
		}
		return nil
	}
	a := startReplica(t, srv, "a", 2, work)
	t.Cleanup(func() { close(drained) }) // before a is stopped: cleanups run last first
	natstest.Eventually(t, 10*time.Second, ownedEquals(a, all(2)))

	// An intruder writes the lease over, with a TTL: a's next renewal is refused, and the
	// partition is free again 2 s later.
	m := nats.NewMsg("$KV." + bucket + "." + wire.LeaseKey(lost))
	m.Data = []byte("intruder")
	m.Header.Set("Nats-TTL", "2s")
	if _, err := js.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if !errors.Is(ended[lost], election.ErrLeaseLost) {
			return fmt.Errorf("a's Work of partition %d not ended by the lost lease yet (%v)", lost, ended[lost])
		}
		return nil
	})

	b := startReplica(t, srv, "b", 2, func(ctx context.Context, _ *election.Lease) error {
		<-ctx.Done()
		return nil
	})
	natstest.Eventually(t, 20*time.Second, func() error {
		mu.Lock()
		cause, handed := ended[keep]
		mu.Unlock()
		if handed {
			t.Fatalf("a handed partition %d over (%v) while its lost partition %d's Work was still returning: it counted that one in its quota", keep, cause, lost)
		}
		if got := b.e.Owned(); !slices.Equal(got, []int{lost}) {
			return fmt.Errorf("b owns %v, want [%d], freed when the intruder's lease expired", got, lost)
		}
		return nil
	})
	if got := a.e.Owned(); !slices.Contains(got, keep) {
		t.Errorf("a owns %v, want %d among them", got, keep)
	}
}
