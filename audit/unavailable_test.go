package audit_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// The audit's requests are asked again while the servers answer 503 (seen in CI right after a
// healed network partition): a server cut off from both others answers "JetStream system
// temporarily unavailable"; once its routes are back the same request must succeed. Each of
// the audit's kinds of request is tried: creating its consumers, and reading a stream's state
// (an audit that gave up there failed, or took PARKED for empty).
func TestRequestsWaitOutUnavailableJetStream(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		// replicas of stream S. A node cut off answers a stream info request itself while it
		// leads the stream or is a member whose group has no leader (with what it last knew), so
		// that case reads an R1 stream that lives on another node: the node cut off then has
		// only a 503 to give.
		replicas int
		// try makes the request straight, as the audit did before it retried.
		try func(ctx context.Context, js jetstream.JetStream, stream string) error
		// call makes it through the audit's helper.
		call func(ctx context.Context, js jetstream.JetStream, stream string, retried func(error)) error
	}{
		{
			name:     "consumer",
			replicas: 3,
			try: func(ctx context.Context, js jetstream.JetStream, stream string) error {
				_, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{InactiveThreshold: 30 * time.Second})
				return err
			},
			call: func(ctx context.Context, js jetstream.JetStream, stream string, retried func(error)) error {
				_, err := audit.OrderedConsumer(ctx, js, stream, jetstream.OrderedConsumerConfig{InactiveThreshold: 30 * time.Second}, retried)
				return err
			},
		},
		{
			name:     "stream info",
			replicas: 1,
			try: func(ctx context.Context, js jetstream.JetStream, stream string) error {
				_, err := js.Stream(ctx, stream)
				return err
			},
			call: func(ctx context.Context, js jetstream.JetStream, stream string, retried func(error)) error {
				info, err := audit.StreamInfo(ctx, js, stream, retried, jetstream.WithDeletedDetails(true))
				if err == nil && info.State.Msgs != 1 {
					return errors.New("stream info without the stream's one message")
				}
				return err
			},
		},
		{
			name:     "stream if allowed",
			replicas: 1,
			try: func(ctx context.Context, js jetstream.JetStream, stream string) error {
				_, err := js.Stream(ctx, stream)
				return err
			},
			call: func(ctx context.Context, js jetstream.JetStream, stream string, retried func(error)) error {
				s, err := audit.StreamIfAllowed(ctx, js, stream, retried)
				if err == nil && s.CachedInfo().State.Msgs != 1 {
					return errors.New("stream info without the stream's one message")
				}
				return err
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Each case waits out its own cluster's elections: side by side.
			t.Parallel()
			c := natstest.StartCluster(t, 3)
			admin, err := jetstream.New(c.Connect(t, 0))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			const stream = "S"
			if _, err := admin.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{"s"}, Replicas: tc.replicas}); err != nil {
				t.Fatalf("CreateStream: %v", err)
			}
			if _, err := admin.Publish(ctx, "s", []byte("one")); err != nil {
				t.Fatalf("Publish: %v", err)
			}
			// The node cut off is one that does not lead the stream.
			alone := (c.WaitStreamLeader(stream, -1, 10*time.Second) + 1) % c.Size()
			js, err := jetstream.New(c.Connect(t, alone))
			if err != nil {
				t.Fatal(err)
			}
			c.MoveMetaLeaderOff(alone)
			var others []int
			for i := range c.Size() {
				if i != alone {
					others = append(others, i)
					c.CutRoutes(i)
				}
			}
			mended := false
			mend := func() {
				for _, i := range others {
					c.MendRoutes(i)
				}
				mended = true
			}
			defer func() {
				if !mended {
					mend()
				}
			}()
			// The fault struck: the node alone answers the request with a 503.
			natstest.Eventually(t, 30*time.Second, func() error {
				actx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				err := tc.try(actx, js, stream)
				var apiErr *jetstream.APIError
				if errors.As(err, &apiErr) && apiErr.Code == 503 {
					return nil
				}
				return fmt.Errorf("node %d alone still answers: %s", alone, errString(err))
			})
			// Mend the routes at the helper's first retry: it saw the 503 and must wait it out.
			retried := make(chan error, 1)
			got := make(chan error, 1)
			go func() {
				got <- tc.call(ctx, js, stream, func(err error) {
					select {
					case retried <- err:
					default:
					}
				})
			}()
			select {
			case err := <-retried:
				t.Logf("retried after %v", err)
			case err := <-got:
				t.Fatalf("returned (%v) without waiting out the 503", err)
			}
			mend()
			if err := <-got; err != nil {
				t.Fatalf("after the routes came back: %v, want an answer", err)
			}
		})
	}
}

func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}
