package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// The cause of a lane's context says why it ends: ErrFenced (the lease is lost) stops it at once,
// sending nothing more, not even the resends a drain makes; any other cause (a release) lets it
// drain, resending what is unacknowledged until DrainTimeout. Nothing is ever acknowledged here:
// OUTGOING is gone and a silent subscriber counts what the lane sends.
func TestContextCauseDecidesTheDrain(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	const drain = 10 * time.Second
	for name, tc := range map[string]struct {
		cause  error
		drains bool
	}{
		"lease lost": {cause: fmt.Errorf("%w: lease lost", lanes.ErrFenced)},
		"released":   {cause: errors.New("released"), drains: true},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			if err := f.js.DeleteStream(context.Background(), "OUTGOING"); err != nil {
				t.Fatal(err)
			}
			var sent atomic.Int64
			nc := f.srv.Connect(t)
			if _, err := nc.Subscribe("outgoing.>", func(*nats.Msg) { sent.Add(1) }); err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			dev := "dev-c"
			f.groups.set(dev, "g")
			pool, err := lanes.New(f.js, f.ctl, f.groups.lookup, lanes.Config{Layout: f.lay,
				PublishTimeout: 200 * time.Millisecond, RetryBackoff: 10 * time.Millisecond,
				MaxRetryBackoff: 50 * time.Millisecond, DrainTimeout: drain})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			res := make(chan error, 1)
			go func() {
				res <- pool.Run(ctx, lanes.Assignment{Partition: subjects.Partition(dev, 16), Epoch: 1})
			}()
			f.publish([]string{dev}, 5, nil)
			natstest.Eventually(t, 20*time.Second, func() error {
				if pool.Stats().Retries == 0 {
					return errors.New("the lane is not resending yet")
				}
				return nil
			})
			start := time.Now()
			cancel(tc.cause)
			atCancel := sent.Load()
			select {
			case err := <-res:
				if err != nil {
					t.Errorf("Run() = %v, want nil: the caller ended it", err)
				}
			case <-time.After(drain + 20*time.Second):
				t.Fatal("Run did not return")
			}
			took, after := time.Since(start), sent.Load()-atCancel
			t.Logf("Run returned %v after the cancel; %d publishes after it", took, after)
			switch {
			case tc.drains && (took < drain/2 || after <= 5):
				t.Errorf("released lane returned after %v with %d publishes after the cancel; want a drain of about %v that resends", took, after, drain)
			case !tc.drains && (took > drain/2 || after > 5):
				// A round of resends sent just before the cancel may reach the subscriber after it:
				// at most the 5 messages in flight.
				t.Errorf("fenced lane returned after %v with %d publishes after the cancel; want it at once, with at most the round already on its way (5)", took, after)
			}
		})
	}
}
