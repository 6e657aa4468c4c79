package lanes

import (
	"context"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/wire"
)

// watchUnpark watches the partition's unpark.<p>.<device> keys and hands each put to the lane,
// until ctx ends; the initial values come first, so a key put before this lane claimed (or for
// a lane that stopped before acting on it) is seen.
func (l *lane) watchUnpark(ctx context.Context) {
	s := l.park
	prefix := wire.UnparkKey(l.a.Partition, "")
	backoff := l.p.cfg.RetryBackoff
	for ctx.Err() == nil {
		w, err := l.p.ctl.Watch(ctx, wire.UnparkFilter(l.a.Partition), jetstream.IgnoreDeletes())
		if err == nil {
			for e := range w.Updates() {
				if e == nil {
					continue
				}
				backoff = l.p.cfg.RetryBackoff
				device, _ := strings.CutPrefix(e.Key(), prefix)
				mode := drainForce
				if wire.ParseUnparkAction(e.Value()) == wire.UnparkDrop {
					mode = drainDrop
				}
				if !s.send(ctx, parkEvent{kind: evUnpark, device: device, mode: mode, rev: e.Revision()}) {
					break
				}
			}
			_ = w.Stop()
		}
		if ctx.Err() != nil {
			return
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
		backoff = min(2*backoff, l.p.cfg.MaxRetryBackoff)
	}
}

// unparkRequest acts on an unpark key: the device's drain (running, queued or new) becomes one
// that empties its park, and the key is deleted once it has. A device that is not parked has its
// key deleted at once.
func (l *lane) unparkRequest(device string, mode drainMode, rev uint64) {
	s := l.park
	dev := s.devices[device]
	if dev == nil {
		l.log.Info().Str("device", device).Msg("unpark: the device has nothing parked")
		l.deleteUnparkKey(device, rev)
		return
	}
	dev.unpark, dev.unparkRev = mode, rev
	switch {
	case dev.drain != nil:
		// A drain that stopped (a release without a group) is queued again in this mode
		// when it finishes; one that runs goes on in it.
		dev.drain.mode = mode
	case dev.queued != 0:
		dev.queued = mode
	default:
		l.queueDrain(dev, mode)
	}
}

// deleteUnparkKey deletes device's unpark key if it still has revision rev (a newer put is a new
// request), on a goroutine of its own.
func (l *lane) deleteUnparkKey(device string, rev uint64) {
	s := l.park
	key := wire.UnparkKey(l.a.Partition, device)
	s.wg.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := l.p.ctl.Delete(ctx, key, jetstream.LastRevision(rev)); err != nil {
			l.p.warn("unpark-delete", func(e *zerolog.Event) {
				e.Str("key", key).Err(err).Msg("deleting the unpark key failed (it is acted on again at the next claim)")
			})
		}
	})
}
