package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// inprocReplica is one replica composed in this process from kv, lanes and election, wired as
// replica.go wires them, so that a test can reach inside it (hold its groups watch back).
type inprocReplica struct {
	t       *testing.T
	table   *kv.Table
	elector *election.Elector

	stopElection func() // cancels the elector's Run and waits for it; idempotent
}

// replicaWork is replica.go's election.Work: keep the two identical. A claimed partition maps
// nothing until the groups table has caught up with the bucket as it was at the claim.
func replicaWork(table *kv.Table, pool *lanes.Pool, log zerolog.Logger) election.Work {
	return func(ctx context.Context, l *election.Lease) error {
		if err := table.CatchUp(ctx); err != nil {
			if ctx.Err() != nil {
				log.Info().Err(err).Int("partition", l.Partition).
					Msg("partition ended before the groups table caught up")
				return nil
			}
			return err
		}
		return pool.Run(ctx, lanes.Assignment{Partition: l.Partition, Epoch: l.Epoch, Valid: l.Valid})
	}
}

// startInprocReplica builds replica id on its own connection and runs its groups table until the
// test ends; it returns once the table is loaded. The election starts with elect.
func (e *env) startInprocReplica(id string, kcfg kv.Config) *inprocReplica {
	e.t.Helper()
	t := e.t
	_, js := e.srv.JetStream(t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1))
	ctx := context.Background()
	groups, err := js.KeyValue(ctx, "device-groups")
	if err != nil {
		t.Fatal(err)
	}
	control, err := js.KeyValue(ctx, "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	table, err := kv.New(groups, kcfg)
	if err != nil {
		t.Fatalf("kv.New: %v", err)
	}
	pool, err := lanes.New(js, control, func(device string) (string, uint64, string) {
		ent, ok := table.Lookup(device)
		if !ok {
			return "", 0, lanes.ReasonNoMapping
		}
		return ent.Group, ent.Revision, ent.Reason
	}, lanes.Config{
		Layout: layout(t), CheckpointInterval: 50 * time.Millisecond,
		PublishTimeout: 2 * time.Second, DrainTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatalf("lanes.New: %v", err)
	}
	elector, err := election.New(js, control, replicaWork(table, pool, zerolog.Nop()), election.Config{
		ReplicaID: id, Partitions: partitions,
		LeaseTTL: time.Second, RenewInterval: 200 * time.Millisecond, Grace: time.Second,
		ReleaseTimeout: pool.DrainTimeout() + 10*time.Second,
	})
	if err != nil {
		t.Fatalf("election.New: %v", err)
	}
	r := &inprocReplica{t: t, table: table, elector: elector, stopElection: func() {}}
	t.Cleanup(runUntilCleanup(t, id+" groups table", table.Run))
	select {
	case <-table.Ready():
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: groups table not loaded within 30s", id)
	}
	return r
}

// elect starts the replica's election; stopElection stops it the way SIGTERM does, handing
// every partition over, and waits for it.
func (r *inprocReplica) elect() {
	stop := runUntilCleanup(r.t, "election", r.elector.Run)
	var once sync.Once
	r.stopElection = func() { once.Do(stop) }
	r.t.Cleanup(r.stopElection)
}

// runUntilCleanup runs f on its own goroutine and returns a func that cancels it, waits for it
// and checks that it returned nil.
func runUntilCleanup(t *testing.T, what string, f func(context.Context) error) func() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f(ctx) }()
	return func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s: Run() = %v, want nil", what, err)
			}
		case <-time.After(60 * time.Second):
			t.Errorf("%s: Run did not return within 60s of cancel", what)
		}
	}
}

// TestGroupSwitchSurvivesHandoffToALaggingReplica checks I4 across a handoff: replica B takes a
// partition over while its groups watch has not applied the move replica A already mapped with,
// and must map nothing of the moved device until it has; then everything lands in the new group,
// in order, and nothing after the switch in the old one.
func TestGroupSwitchSurvivesHandoffToALaggingReplica(t *testing.T) {
	e := newEnv(t)
	const dev = "dev-42"
	p := subjects.Partition(dev, partitions)
	e.put(dev, "group-a")

	a := e.startInprocReplica("a", kv.Config{})
	// B's watch parks on the key "barrier" until the test releases it: every later update,
	// the move of dev-42 among them, stays unapplied by B.
	reached, gate := make(chan struct{}), make(chan struct{})
	var reachedOnce, gateOnce sync.Once
	release := func() { gateOnce.Do(func() { close(gate) }) }
	b := e.startInprocReplica("b", kv.Config{RetryMin: 10 * time.Millisecond, OnUpdate: func(u kv.Update) {
		if u.Device == "barrier" {
			reachedOnce.Do(func() { close(reached) })
			<-gate
		}
	}})
	t.Cleanup(release) // runs before B's table is stopped, which waits for the watch

	a.elect()
	natstest.Eventually(t, 30*time.Second, func() error {
		if !slices.Contains(a.elector.Owned(), p) {
			return fmt.Errorf("A owns %v, not partition %d of %s yet", a.elector.Owned(), p, dev)
		}
		return nil
	})
	ld := newLoad(t, e.js)
	ld.publish([]string{dev}, 5) // messages 0–4, before the switch
	e.readStream("OUTGOING", 5, 30*time.Second)

	e.put("barrier", "x")
	select {
	case <-reached:
	case <-time.After(30 * time.Second):
		t.Fatal("B's watch did not reach the barrier within 30s")
	}
	e.put(dev, "group-b")
	natstest.Eventually(t, 30*time.Second, func() error {
		if got, _ := a.table.Lookup(dev); got.Group != "group-b" {
			return fmt.Errorf("A: Lookup(%s) = %+v, want group-b", dev, got)
		}
		return nil
	})
	if got, _ := b.table.Lookup(dev); got.Group != "group-a" {
		t.Fatalf("B: Lookup(%s) = %+v while its watch is held, want group-a", dev, got)
	}
	ld.publish([]string{dev}, 5) // messages 5–9, mapped by A after the switch
	e.readStream("OUTGOING", 10, 30*time.Second)

	// Hand everything over to B: B joins, A leaves the way SIGTERM makes it, deleting its leases.
	b.elect()
	a.stopElection()
	natstest.Eventually(t, 30*time.Second, func() error {
		if !slices.Contains(b.elector.Owned(), p) {
			return fmt.Errorf("B owns %v, not partition %d of %s yet", b.elector.Owned(), p, dev)
		}
		return nil
	})
	ld.publish([]string{dev}, 5) // messages 10–14, INCOMING only while B's table lags

	// B holds the lease; its table still says group-a. For a sustained window, nothing more of
	// dev-42 may reach OUTGOING.
	window := time.Now().Add(3 * time.Second)
	for time.Now().Before(window) {
		if n := e.count("OUTGOING"); n != 10 {
			msgs := e.readStream("OUTGOING", n, time.Second)
			var late []string
			for _, m := range msgs[10:] {
				late = append(late, fmt.Sprintf("%s %q", m.Subject(), m.Data()))
			}
			t.Fatalf("OUTGOING holds %d messages while B's groups table lags, want 10; mapped by B: %s",
				n, strings.Join(late, ", "))
		}
		poll := time.NewTimer(50 * time.Millisecond)
		<-poll.C
	}

	release()
	msgs := e.readStream("OUTGOING", 15, 30*time.Second)
	got := perDevice(t, msgs, map[string]int{dev: 15})[dev]
	for i, subj := range got {
		want := "outgoing.group-a." + dev + ".evt"
		if i >= 5 {
			want = "outgoing.group-b." + dev + ".evt"
		}
		if subj != want {
			t.Errorf("message %d of %s on %s, want %s", i, dev, subj, want)
		}
	}
}
