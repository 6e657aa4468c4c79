package lanes

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/wire"
)

// ErrIncomingRecreated is returned by [Pool.Run] when INCOMING (or, in the partition-streams
// layout, the partition's stream) was deleted and created again while the lane was reading it:
// the stream's sequences start again, so the lane's position means nothing in the new stream.
// The partition's next run starts from the new stream's first message.
var ErrIncomingRecreated = errors.New("lanes: INCOMING was re-created")

// incoming reads the incarnation and state of stream, one that holds INCOMING messages.
func (p *Pool) incoming(ctx context.Context, stream string) (inc string, st jetstream.StreamState, err error) {
	s, err := p.js.Stream(ctx, stream)
	if err != nil {
		return "", st, fmt.Errorf("reading stream %s: %w", stream, err)
	}
	info := s.CachedInfo()
	return wire.Incarnation(info.Created), info.State, nil
}

// incarnation is a stream's incarnation as last read, and when.
type incarnation struct {
	inc string
	at  time.Time
}

// currentIncarnation returns the incarnation of stream, read at most once per half
// IncarnationCheck for all the pool's lanes that read it: all of them in the single-stream
// layout, one in the partition-streams layout.
func (p *Pool) currentIncarnation(ctx context.Context, stream string) (string, error) {
	p.incMu.Lock()
	defer p.incMu.Unlock()
	if c, ok := p.incs[stream]; ok && time.Since(c.at) < p.cfg.IncarnationCheck/2 {
		return c.inc, nil
	}
	inc, _, err := p.incoming(ctx, stream)
	if err != nil {
		return "", err
	}
	p.incs[stream] = incarnation{inc: inc, at: time.Now()}
	return inc, nil
}

// watchIncarnation reports [ErrIncomingRecreated] on l.readErr when INCOMING changes its
// incarnation, checking every IncarnationCheck until ctx is done. Deliveries after a consumer
// reset are checked as they come (see consume); this catches a new stream that delivers
// nothing, because it holds fewer messages than the lane's position in the old one.
func (l *lane) watchIncarnation(ctx context.Context) {
	t := time.NewTicker(l.p.cfg.IncarnationCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, l.p.cfg.IncarnationCheck)
		inc, err := l.p.currentIncarnation(rctx, l.stream)
		cancel()
		if err != nil || inc == l.inc {
			continue // a missing stream shows in the reader's warnings
		}
		select {
		case l.readErr <- fmt.Errorf("%w: partition %d was reading incarnation %s, %s is now %s", ErrIncomingRecreated, l.a.Partition, l.inc, l.stream, inc):
		default: // the reader reported it first
		}
		return
	}
}
