package lanes

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ErrIncomingRecreated is returned by [Pool.Run] when INCOMING (or, in the partition-streams
// layout, the partition's stream) was deleted and created again while the lane was reading it:
// the stream's sequences start again, so the lane's position means nothing in the new stream.
// The partition's next run starts from the new stream's first message.
var ErrIncomingRecreated = errors.New("lanes: INCOMING was re-created")

// Incarnation names one life of a stream: its creation time as a short token (base 36 of the
// Unix nanoseconds). A stream deleted and created again under the same name has another one.
// Checkpoints and Nats-Msg-Ids carry it, so that neither is taken for a position in, or a
// message of, another life of INCOMING: its sequences start again at 1.
func Incarnation(created time.Time) string {
	return strconv.FormatInt(created.UnixNano(), 36)
}

// MsgIDPrefix is the start of the Nats-Msg-Id of every message republished from one
// incarnation of the stream named incoming: "<incoming>:<incarnation>:", followed by the
// message's INCOMING sequence.
func MsgIDPrefix(incoming, incarnation string) string {
	return incoming + ":" + incarnation + ":"
}

// Checkpoint is the value of checkpoint.<p>: the last INCOMING sequence of the partition whose
// republish was acknowledged, in one incarnation of INCOMING. It is stored as
// "<incarnation>:<sequence>"; a value written by kvmapper before incarnations ("<sequence>")
// reads with Incarnation "".
type Checkpoint struct {
	Incarnation string
	Seq         uint64
}

// ParseCheckpoint reads a checkpoint value.
func ParseCheckpoint(v []byte) (Checkpoint, error) {
	inc, seq, found := bytes.Cut(v, []byte(":"))
	if !found {
		inc, seq = nil, v
	}
	n, err := strconv.ParseUint(string(seq), 10, 64)
	if err != nil || (found && len(inc) == 0) {
		return Checkpoint{}, fmt.Errorf("lanes: checkpoint %q is not <incarnation>:<sequence>", v)
	}
	return Checkpoint{Incarnation: string(inc), Seq: n}, nil
}

// Append appends the stored form of c to b.
func (c Checkpoint) Append(b []byte) []byte {
	if c.Incarnation != "" {
		b = append(append(b, c.Incarnation...), ':')
	}
	return strconv.AppendUint(b, c.Seq, 10)
}

// String returns the stored form of c.
func (c Checkpoint) String() string { return string(c.Append(nil)) }

// incoming reads the incarnation and state of stream, one that holds INCOMING messages.
func (p *Pool) incoming(ctx context.Context, stream string) (inc string, st jetstream.StreamState, err error) {
	s, err := p.js.Stream(ctx, stream)
	if err != nil {
		return "", st, fmt.Errorf("reading stream %s: %w", stream, err)
	}
	info := s.CachedInfo()
	return Incarnation(info.Created), info.State, nil
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
