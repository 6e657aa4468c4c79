package natstest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// TestClusterKillIsACrash checks what the cluster tests rely on: Kill leaves a stream leaderless
// until a Raft election timer fires (seconds), where a step-down hands leadership over at once;
// a client that named only the killed node fails over to the servers it learnt of; a node
// restarted after missing writes catches up.
func TestClusterKillIsACrash(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	nc := c.Connect(t, 0, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Replicas: 3}); err != nil {
		t.Fatalf("CreateStream: %v", err)
	}
	publish := func(n int) {
		t.Helper()
		for range n {
			if _, err := js.Publish(ctx, "s.x", []byte("x")); err != nil {
				t.Fatalf("Publish: %v", err)
			}
		}
	}
	publish(10)

	start := time.Now()
	from, to := c.StepDown(nc, "S")
	stepDown := time.Since(start)
	t.Logf("step-down %s → %s took %v", c.Name(from), c.Name(to), stepDown)

	leader := c.WaitStreamLeader("S", -1, 10*time.Second)
	// A client of the leader's node alone, as a user who names one server.
	lone, err := nats.Connect(c.URL(leader), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer lone.Close()
	start = time.Now()
	c.Kill(leader)
	next := c.WaitStreamLeader("S", leader, 30*time.Second)
	election := time.Since(start)
	t.Logf("kill of %s: %s elected after %v", c.Name(leader), c.Name(next), election)
	// Raft's election timer is at least 4 s after the last heartbeat, which is at most 1 s old:
	// a leader elected within 2 s was handed over, not elected after a crash.
	if election < 2*time.Second {
		t.Errorf("a new leader %v after Kill, want an election (≥ 3 s): Kill let the leader hand over", election)
	}
	if stepDown >= election {
		t.Errorf("step-down took %v, the election after a kill %v: want the step-down faster", stepDown, election)
	}

	natstest.Eventually(t, 10*time.Second, func() error {
		if !lone.IsConnected() || lone.ConnectedUrl() == c.URL(leader) {
			return fmt.Errorf("a client of the killed node only: %v, at %s", lone.Status(), lone.ConnectedUrl())
		}
		return nil
	})

	publish(10) // the restarted node missed these
	c.Restart(leader)
	c.WaitStreamCurrent("S", 30*time.Second)
	s, err := js.Stream(ctx, "S")
	if err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 30*time.Second, func() error {
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.Msgs != 20 || len(info.Cluster.Replicas) != 2 {
			return fmt.Errorf("after restart: %d messages, %d followers; want 20 and 2", info.State.Msgs, len(info.Cluster.Replicas))
		}
		for _, r := range info.Cluster.Replicas {
			if !r.Current {
				return fmt.Errorf("replica %s not current", r.Name)
			}
		}
		return nil
	})
}

// TestMoveMetaLeaderOff checks what the cluster tests rely on before a kill: the meta group's
// leader leaves the node named, and clients without credentials still use JetStream.
func TestMoveMetaLeaderOff(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	meta := c.MetaLeader()
	c.MoveMetaLeaderOff(meta)
	if got := c.MetaLeader(); got == meta || got < 0 {
		t.Fatalf("MetaLeader() = %d after MoveMetaLeaderOff(%d), want another node", got, meta)
	}
	other := (c.MetaLeader() + 1) % 3
	c.MoveMetaLeaderOff(other) // not the leader: nothing to do
	js, err := jetstream.New(c.Connect(t, 0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Replicas: 3}); err != nil {
		t.Fatalf("CreateStream without credentials: %v", err)
	}
}
