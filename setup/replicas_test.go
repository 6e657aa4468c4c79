package setup_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
)

// TestEnsureSaysWhyReplicasCannotBePlaced asks for 3 replicas from a single server and from a
// cluster of two: Ensure fails with ErrInvalidConfig and says what to do, instead of the
// server's bare error.
func TestEnsureSaysWhyReplicasCannotBePlaced(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		start func(t *testing.T) jetstream.JetStream
		want  string
	}{
		{"single server", func(t *testing.T) jetstream.JetStream {
			_, js := natstest.Start(t).JetStream(t)
			return js
		}, "not in a JetStream cluster"},
		{"two of three", func(t *testing.T) jetstream.JetStream {
			js, err := jetstream.New(natstest.StartCluster(t, 2).Connect(t, 0))
			if err != nil {
				t.Fatal(err)
			}
			return js
		}, "cannot place them"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			js := tc.start(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), Replicas: 3})
			if !errors.Is(err, setup.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Ensure(Replicas: 3) = %v, want ErrInvalidConfig saying %q", err, tc.want)
			}
			t.Log(err)
		})
	}
}
