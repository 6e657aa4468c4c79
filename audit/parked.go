package audit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// readParked counts, after both outputs were read, the audited INCOMING messages the PARKED
// stream holds that neither output had: they are parked (their device has no group yet), not
// missing. It reads PARKED headers only, once; a message in PARKED and in an output is one
// released and not yet purged, which is no duplicate. A PARKED that is missing, or that the user
// may not read, holds nothing.
func (a *auditor) readParked(ctx context.Context, js jetstream.JetStream) (uint64, error) {
	name := a.cfg.Parked
	if a.missing.Load() == 0 {
		return 0, nil // nothing to look for: PARKED is not even opened (it may not be allowed)
	}
	s, err := streamIfAllowed(ctx, js, name, nil)
	if err != nil {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		// No PARKED (or not allowed to read it): what is missing stays missing.
		return 0, nil
	}
	st := s.CachedInfo().State
	if st.Msgs == 0 {
		return 0, nil
	}
	cons, err := orderedConsumer(ctx, js, name, jetstream.OrderedConsumerConfig{
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		HeadersOnly:       true,
		InactiveThreshold: 30 * time.Second,
	}, nil)
	if err != nil {
		return 0, fmt.Errorf("audit: creating a consumer on stream %s: %w", name, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(pullBatch))
	if err != nil {
		return 0, fmt.Errorf("audit: reading stream %s: %w", name, err)
	}
	defer func() {
		it.Stop()
		if ci := cons.CachedInfo(); ci != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = js.DeleteConsumer(dctx, name, ci.Name) // best effort: InactiveThreshold is the fallback
			cancel()
		}
	}()
	defer context.AfterFunc(ctx, it.Stop)()
	var parked uint64
	for {
		m, err := it.Next(jetstream.NextMaxWait(idleCheck))
		if errors.Is(err, nats.ErrTimeout) {
			return parked, nil // what was left was purged (released) meanwhile
		}
		if err != nil {
			if ctx.Err() != nil {
				return 0, ctx.Err()
			}
			return 0, fmt.Errorf("audit: reading stream %s: %w", name, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return 0, fmt.Errorf("audit: reading stream %s: %w", name, err)
		}
		// A fence record (kvmapper.fence.PARKED.<p>…) is no parked message; it has no id of
		// INCOMING's either, but is skipped by its subject, as the outputs' are.
		fence := strings.HasPrefix(m.Subject(), fencePrefix)
		if src, seq, ok := a.sourceOf(m.Headers().Get(nats.MsgIdHdr), md.Timestamp.UnixNano()); ok && !fence {
			if inRange, dup := a.mark(src, seq); inRange && !dup {
				parked++
			}
		}
		if md.Sequence.Stream >= st.LastSeq || md.NumPending == 0 {
			return parked, nil
		}
	}
}
