package lanes

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

// queuePurge queues a purge of device's parked messages up to PARKED sequence seq.
func (l *lane) queuePurge(device string, seq uint64) {
	s := l.park
	if seq == 0 {
		return
	}
	if old, ok := s.purges[device]; ok {
		s.purges[device] = max(old, seq)
		return
	}
	s.purges[device] = seq
	s.purgeList = append(s.purgeList, device)
}

// startPurge starts the next queued purge on a goroutine, if none is in flight: at most one per
// lane. A purge removes only messages a drain had republished and seen acknowledged. It runs
// under parking's context, which the lane's stop cancels: a fenced lane does not wait for a
// purge that goes unanswered (up to its 5 s timeout) before Run returns.
func (l *lane) startPurge() {
	s := l.park
	if s.purging || len(s.purgeList) == 0 || !l.valid() {
		return
	}
	device := s.purgeList[0]
	seq := s.purges[device]
	s.purgeList = s.purgeList[1:]
	delete(s.purges, device)
	s.purging = true
	ctx := s.gctx
	s.wg.Go(func() {
		err := l.purge(ctx, device, seq)
		s.send(context.WithoutCancel(ctx), parkEvent{kind: evPurged, device: device, seq: seq, err: err})
	})
}

// purge removes device's parked messages up to and including PARKED sequence seq.
func (l *lane) purge(ctx context.Context, device string, seq uint64) error {
	s := l.park
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ps := s.parked
	if ps == nil {
		var err error
		if ps, err = l.p.js.Stream(ctx, s.cfg.Stream); err != nil {
			return err
		}
	}
	return ps.Purge(ctx, jetstream.WithPurgeSubject(subjects.ParkedSubject(s.cfg.Prefix, l.a.Partition, device)),
		jetstream.WithPurgeSequence(seq+1))
}

// purged takes in the end of a purge; a failed one is queued again for the next tick.
func (l *lane) purged(ev parkEvent) {
	s := l.park
	s.purging = false
	if ev.err != nil {
		l.p.warn("park-purge", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Str("device", ev.device).Err(ev.err).
				Msg("purging released messages from PARKED failed; will retry (until then a new owner would find them and skip them)")
		})
		l.queuePurge(ev.device, ev.seq)
	}
}

// stopParking ends parking when the lane stops: it stops the drains' readers and, unless the
// lane is fenced (why is not nil, or the lease ran out), waits until ctx ends for the drains'
// publishes in flight, then purges what they republished. The lane's window room they held is
// given back.
func (l *lane) stopParking(ctx context.Context, why error) {
	s := l.park
	if s == nil || s.stopped {
		return
	}
	s.stopped = true
	for _, d := range s.drains {
		d.stopReader()
		d.held = nil
	}
	if why == nil && l.valid() {
		for _, d := range s.drains {
			d.w.Flush()
		}
		// A purge in flight is waited for too: the deferred end of parking cancels it.
		for (l.drainsUnsettled() || s.purging) && ctx.Err() == nil {
			select {
			case m := <-l.in.C():
				l.in.Handle(m)
			case ev := <-s.events:
				if ev.kind == evPurged {
					s.purging = false
				}
			case <-ctx.Done():
			}
		}
	}
	for _, d := range s.drains {
		l.drainPop(d)
		l.drainRelease(d)
		if d.through > 0 {
			l.queuePurge(d.dev.name, d.through)
		}
	}
	if why != nil || !l.valid() {
		return
	}
	for _, device := range s.purgeList {
		if ctx.Err() != nil {
			break
		}
		if err := l.purge(ctx, device, s.purges[device]); err != nil {
			l.log.Debug().Str("device", device).Err(err).Msg("final purge of released messages failed")
		}
	}
}
