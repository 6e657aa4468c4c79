package setup_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// TestEnsureFencesReplicatedOutputs: on a cluster with 3 replicas, setup makes OUTGOING and
// UNMAPPED capture their fence subjects, take atomic batches and allow rollups (each record
// replaces the partition's last), and records them in the control
// bucket; an OUTGOING made earlier without them is updated. On one server it fences nothing and
// records nothing: the lease clock is the fence there.
func TestEnsureFencesReplicatedOutputs(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	t.Run("cluster", func(t *testing.T) {
		js, err := jetstream.New(natstest.StartCluster(t, 3).Connect(t, 0))
		if err != nil {
			t.Fatal(err)
		}
		// An OUTGOING from before fences: setup adds them.
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTGOING", Subjects: []string{"outgoing.>"},
			Duplicates: 2 * time.Minute, Replicas: 3}); err != nil {
			t.Fatal(err)
		}
		lines, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), Replicas: 3})
		if err != nil {
			t.Fatalf("Ensure: %v", err)
		}
		t.Log(lines[len(lines)-1])
		for _, name := range []string{"OUTGOING", "UNMAPPED"} {
			s, err := js.Stream(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			c := s.CachedInfo().Config
			if !slices.Contains(c.Subjects, subjects.FenceFilter(name)) || !c.AllowAtomicPublish || !c.AllowRollup {
				t.Errorf("stream %s: subjects %v, allow_atomic %v, allow_rollup_hdrs %v; want %s captured, atomic batches and rollups (of fence records) allowed",
					name, c.Subjects, c.AllowAtomicPublish, c.AllowRollup, subjects.FenceFilter(name))
			}
		}
		ctl, err := js.KeyValue(ctx, "kvmapper")
		if err != nil {
			t.Fatal(err)
		}
		if got, err := setup.ReadFences(ctx, ctl); err != nil || !slices.Equal(got, []string{"OUTGOING", "UNMAPPED"}) {
			t.Errorf("ReadFences = %v, %v; want [OUTGOING UNMAPPED]", got, err)
		}
	})
	t.Run("one server", func(t *testing.T) {
		_, js := natstest.Start(t).JetStream(t)
		if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16)}); err != nil {
			t.Fatalf("Ensure: %v", err)
		}
		s, err := js.Stream(ctx, "OUTGOING")
		if err != nil {
			t.Fatal(err)
		}
		if c := s.CachedInfo().Config; len(c.Subjects) != 1 || c.AllowAtomicPublish {
			t.Errorf("OUTGOING on one server: subjects %v, allow_atomic %v; want its own subject only", c.Subjects, c.AllowAtomicPublish)
		}
		ctl, err := js.KeyValue(ctx, "kvmapper")
		if err != nil {
			t.Fatal(err)
		}
		if got, err := setup.ReadFences(ctx, ctl); err != nil || got != nil {
			t.Errorf("ReadFences = %v, %v; want none", got, err)
		}
	})
}
