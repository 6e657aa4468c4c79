package lanes

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// ErrNotParking is wrapped by [Unpark]'s error when the deployment has no PARKED stream: nothing
// was ever parked.
var ErrNotParking = errors.New("lanes: nothing is parked")

// UnparkConfig is a request of [Unpark].
type UnparkConfig struct {
	// Layout gives the partition count; Names the PARKED stream, its subjects' prefix and the
	// control bucket. Required.
	Layout *subjects.Layout
	Names  subjects.Names
	// Action says what the owner does with the parked messages. Default [wire.UnparkRelease].
	Action wire.UnparkAction
	// Wait is how long to wait for each device's owner to act; 0 does not wait.
	Wait time.Duration
}

// UnparkResult is what became of the request for one device.
type UnparkResult struct {
	Device    string
	Partition int
	Parked    uint64 // messages of the device in PARKED when it was asked
	Key       string // the unpark key written ([wire.UnparkKey])
	// Waited is set when [UnparkConfig.Wait] was; Err then says why the owner did not act
	// within it (nil: it did). The request stays in Key either way, for the partition's next
	// owner.
	Waited bool
	Err    error
}

// Unpark asks the owner of each device's partition to empty the device's park, through the key
// [wire.UnparkKey] in the control bucket that the lane of that partition watches (watchUnpark):
// one device after the other, each waiting up to cfg.Wait for the owner to delete the key. It
// calls each with every device's result as it comes, and fails (wrapping [ErrNotParking] when
// there is no PARKED stream) on the first error reading PARKED or writing the control bucket.
func Unpark(ctx context.Context, js jetstream.JetStream, cfg UnparkConfig, devices []string, each func(UnparkResult)) error {
	if cfg.Action == "" {
		cfg.Action = wire.UnparkRelease
	}
	n := cfg.Names.WithDefaults()
	ps, err := js.Stream(ctx, n.Parked)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("%w: there is no %s stream (parking is `kvmapper run --on-unmapped park`)", ErrNotParking, n.Parked)
	}
	if err != nil {
		return fmt.Errorf("opening stream %s: %w", n.Parked, err)
	}
	ctl, err := js.KeyValue(ctx, n.Control)
	if err != nil {
		return fmt.Errorf("opening bucket %s: %w", n.Control, err)
	}
	for _, d := range devices {
		p := subjects.Partition(d, cfg.Layout.Partitions)
		subj := subjects.ParkedSubject(n.ParkedPrefix, p, d)
		info, err := ps.Info(ctx, jetstream.WithSubjectFilter(subj))
		if err != nil {
			return fmt.Errorf("reading stream %s: %w", n.Parked, err)
		}
		r := UnparkResult{Device: d, Partition: p, Parked: info.State.Subjects[subj], Key: wire.UnparkKey(p, d)}
		rev, err := ctl.PutString(ctx, r.Key, string(cfg.Action))
		if err != nil {
			return fmt.Errorf("writing %s to bucket %s: %w", r.Key, n.Control, err)
		}
		if cfg.Wait > 0 {
			r.Waited, r.Err = true, waitDeleted(ctx, ctl, r.Key, rev, cfg.Wait)
		}
		each(r)
	}
	return nil
}

// waitDeleted waits until key, put at revision rev, is deleted (the owner acted on it).
func waitDeleted(ctx context.Context, ctl jetstream.KeyValue, key string, rev uint64, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	w, err := ctl.Watch(ctx, key)
	if err != nil {
		return err
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return errors.New("the watch ended")
			}
			if e != nil && e.Revision() > rev && e.Operation() != jetstream.KeyValuePut {
				return nil
			}
			if e != nil && e.Revision() > rev {
				return errors.New("someone wrote the key again")
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
