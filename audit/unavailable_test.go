package audit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// The audit's consumers are asked for again while the servers answer 503 (seen in CI right after
// a healed network partition): a server cut off from both others answers "JetStream system
// temporarily unavailable"; once its routes are back the same request must succeed.
func TestConsumerWaitsOutUnavailableJetStream(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	js, err := jetstream.New(c.Connect(t, 0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s"}, Replicas: 3}); err != nil {
		t.Fatalf("CreateStream: %v", err)
	}
	c.MoveMetaLeaderOff(0)
	c.CutRoutes(1)
	c.CutRoutes(2)
	mended := false
	defer func() {
		if !mended {
			c.MendRoutes(1)
			c.MendRoutes(2)
		}
	}()
	// The fault struck: node 0 alone answers the request with a 503.
	natstest.Eventually(t, 30*time.Second, func() error {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.OrderedConsumer(actx, "S", jetstream.OrderedConsumerConfig{InactiveThreshold: 30 * time.Second})
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.Code == 503 {
			return nil
		}
		return errors.New("node 0 alone still answers consumer requests: " + errString(err))
	})
	// Mend the routes at the helper's first retry: it saw the 503 and must wait it out.
	retried := make(chan error, 1)
	type made struct {
		cons jetstream.Consumer
		err  error
	}
	got := make(chan made, 1)
	go func() {
		cons, err := audit.OrderedConsumer(ctx, js, "S", jetstream.OrderedConsumerConfig{InactiveThreshold: 30 * time.Second}, func(err error) {
			select {
			case retried <- err:
			default:
			}
		})
		got <- made{cons, err}
	}()
	select {
	case err := <-retried:
		t.Logf("retried after %v", err)
	case m := <-got:
		t.Fatalf("orderedConsumer returned (%v) without waiting out the 503", m.err)
	}
	c.MendRoutes(1)
	c.MendRoutes(2)
	mended = true
	m := <-got
	if m.err != nil {
		t.Fatalf("orderedConsumer after the routes came back: %v, want a consumer", m.err)
	}
}

func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}
