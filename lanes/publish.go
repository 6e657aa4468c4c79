package lanes

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/ordered"
)

// A lane writes through package ordered: one writer for its own queue (OUTGOING, UNMAPPED and
// PARKED, in that order of index: see streamOf) and one for each of its drains, all answered on
// the lane's one inbox, which its goroutine reads. The writer keeps the order and resends; the
// lane keeps the window, the lease, the checkpoint and what a refused message becomes.

// Indexes of the output streams in a lane's writer (streamOf).
const (
	outOutgoing = iota
	outUnmapped
	outParked
)

// replyRoom is what a message's reply subject takes on the wire at most: the inbox, a batch id
// and the batch protocol's tokens. It counts in the window.
const replyRoom = 96

// writeModes are how a pool writes each output stream, read from the streams' configurations
// (cached for a while: lanes start often, streams change seldom).
type writeModes struct {
	mu    sync.Mutex
	at    time.Time
	modes map[string]ordered.Mode
	// atomic says which streams allow atomic batches: a fenced stream is written in them rather
	// than in fast-ingest batches, which carry no fence (see newWriter).
	atomic map[string]bool
	slots  map[string]*ordered.Slots
	// fences are the fenced streams as last read (Config.Fences, then Config.RefreshFences),
	// set once the modes were first read; written under mu, read without it (the election's
	// loop asks, and must not wait for a refresh's reads).
	fences atomic.Pointer[[]string]
}

// modesTTL is how long the pool trusts the modes it read.
const modesTTL = 10 * time.Second

// outputs returns the streams a lane writes, each with its mode. A stream that cannot be read
// (missing, no leader) is written singly: its publishes fail until it is back, as before.
func (p *Pool) outputs(ctx context.Context) []ordered.Stream {
	names := []string{p.cfg.Outgoing, p.cfg.Unmapped, p.cfg.Park.Stream}
	m := &p.modes
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.modes == nil || time.Since(m.at) > modesTTL {
		if m.modes == nil {
			m.fences.Store(&p.cfg.Fences)
		}
		if p.cfg.RefreshFences != nil {
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			fences, err := p.cfg.RefreshFences(rctx)
			cancel()
			switch {
			case err != nil:
				p.log.Debug().Err(err).Msg("reading the fenced streams failed; fencing those read before")
			case !slices.Equal(fences, *m.fences.Load()):
				p.log.Info().Strs("fenced", fences).Strs("before", *m.fences.Load()).
					Msg("the fenced output streams changed: partitions taken from now on fence these")
				m.fences.Store(&fences)
			}
		}
		modes := make(map[string]ordered.Mode, len(names))
		atomic := make(map[string]bool, len(names))
		for _, name := range names {
			if name == "" {
				continue
			}
			mode := ordered.ModeSingle
			if !p.cfg.Singles {
				rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				if s, err := p.js.Stream(rctx, name); err == nil {
					mode = ordered.ModeFor(s.CachedInfo().Config)
					atomic[name] = s.CachedInfo().Config.AllowAtomicPublish
				}
				cancel()
			}
			if old, ok := m.modes[name]; !ok || old != mode {
				p.log.Info().Str("stream", name).Str("write_mode", mode.String()).Msg(modeWhy(mode))
			}
			modes[name] = mode
		}
		m.modes, m.atomic, m.at = modes, atomic, time.Now()
		if m.slots == nil {
			m.slots = make(map[string]*ordered.Slots)
		}
	}
	out := make([]ordered.Stream, 3)
	for i, name := range names {
		out[i] = ordered.Stream{Name: name, Mode: m.modes[name]}
		if name == "" {
			out[i].Mode = ordered.ModeSingle
		}
		if i == outParked && out[i].Mode == ordered.ModeBatch {
			// Parking needs the stored sequence of each park, which a fast batch does not say.
			out[i].Mode = ordered.ModeSingle
		}
		if out[i].Mode == ordered.ModeAtomic {
			out[i].Slots = m.slotsLocked(name, p.cfg.MaxOpenBatches)
		}
	}
	return out
}

// slotsLocked returns the slots of stream name's atomic batches, shared by the pool's lanes;
// m.mu is held.
func (m *writeModes) slotsLocked(name string, n int) *ordered.Slots {
	if m.slots == nil {
		m.slots = make(map[string]*ordered.Slots)
	}
	if m.slots[name] == nil {
		m.slots[name] = ordered.NewSlots(n)
	}
	return m.slots[name]
}

// slots returns the slots of stream name's atomic batches.
func (p *Pool) slots(name string) *ordered.Slots {
	p.modes.mu.Lock()
	defer p.modes.mu.Unlock()
	return p.modes.slotsLocked(name, p.cfg.MaxOpenBatches)
}

// fenceSet returns the output streams new lanes fence, read again with the modes.
func (p *Pool) fenceSet(ctx context.Context) []string {
	p.outputs(ctx)
	return slices.Clone(*p.modes.fences.Load())
}

// checkedMode returns how a fenced stream written in mode is written instead, so that every write
// carries the lane's fence: fast-ingest batches carry none (a check on a batch's first message
// fences that message alone, docs/design-fencing.md finding 2), so the stream takes atomic
// batches where it allows them, else checked single publishes, one at a time.
func (p *Pool) checkedMode(name string, mode ordered.Mode) ordered.Mode {
	if mode != ordered.ModeBatch {
		return mode
	}
	p.modes.mu.Lock()
	atomic := p.modes.atomic[name]
	p.modes.mu.Unlock()
	if atomic {
		return ordered.ModeAtomic
	}
	return ordered.ModeSingle
}

func modeWhy(m ordered.Mode) string {
	switch m {
	case ordered.ModeAtomic:
		return "writing the stream in atomic batches (replicated, allow_atomic): nothing later of a device is stored before an earlier one, through leader changes too"
	case ordered.ModeBatch:
		return "writing the stream in fast-ingest batches (allow_batched)"
	}
	return "writing the stream with single publishes: a leader change of it can store a device's later message before an earlier one in flight (kvmapper setup creates output streams that allow batches; an existing one needs allow_batched, or allow_atomic when replicated)"
}

// fellBack is the writer's OnFallback: a stream that refused batches is written singly from now
// on, by every lane of the pool.
func (p *Pool) fellBack(stream string, err error) {
	p.modes.mu.Lock()
	changed := p.modes.modes[stream] != ordered.ModeSingle
	if p.modes.modes != nil {
		p.modes.modes[stream] = ordered.ModeSingle
	}
	p.modes.mu.Unlock()
	if changed {
		p.log.Warn().Str("stream", stream).Err(err).
			Msg("the stream refused a batch: writing it with single publishes from now on (a leader change of it can then reverse a device's order; give it allow_batched, or allow_atomic when replicated)")
	}
}

// WriteModes returns how each output stream is written now ("single", "batch", "atomic"), as
// far as the pool has looked.
func (p *Pool) WriteModes() map[string]string {
	p.modes.mu.Lock()
	defer p.modes.mu.Unlock()
	out := make(map[string]string, len(p.modes.modes))
	for name, m := range p.modes.modes {
		if name == p.cfg.Park.Stream && m == ordered.ModeBatch {
			m = ordered.ModeSingle
		}
		out[name] = m.String()
	}
	return out
}

// writerConfig is the writer's configuration from the pool's.
func (p *Pool) writerConfig() ordered.Config {
	return ordered.Config{
		PublishTimeout:  p.cfg.PublishTimeout,
		StallTimeout:    p.cfg.StallTimeout,
		RetryBackoff:    p.cfg.RetryBackoff,
		MaxRetryBackoff: p.cfg.MaxRetryBackoff,
		OnFallback:      p.fellBack,
		OnFail:          func() { p.failures.Add(1) },
		Elected:         p.leaders.elected,
		LeaderGrace:     leaderGrace,
	}
}

// startWriter subscribes the lane's inbox and makes its writer. The channel holds twice the
// pool's in-flight bound: a message can have two answers coming (a late one and its resend's),
// and a full channel would make nats.go drop answers as a slow consumer.
func (l *lane) startWriter(ctx context.Context) (func(), error) {
	in, err := ordered.NewInbox(l.p.nc, 2*l.p.cfg.MaxInFlight+64)
	if err != nil {
		return nil, fmt.Errorf("lanes: %w", err)
	}
	l.in = in
	l.w = l.newWriter(ctx, 3)
	return in.Close, nil
}

// newWriter makes a writer of the lane's first n output streams (OUTGOING, UNMAPPED, PARKED),
// answered on the lane's inbox, carrying the lane's fences where they were written (an atomic
// stream checks each batch against it: a later owner's record refuses it). A previous owner may
// have stored what it sends first: those are counted as the duplicates they are, one at a time,
// until the first new store.
//
// A drain's writer (n < 3) writes a one-server stream singly rather than in fast-ingest batches:
// a drain purges from PARKED exactly what its release stored, and a fast batch whose answer was
// lost does not say which of its messages were (an atomic batch does, and there are no leader
// changes on one server).
func (l *lane) newWriter(ctx context.Context, n int) *ordered.Writer {
	outs := l.p.outputs(ctx)[:n]
	for i := range outs {
		if _, fenced := l.fences[outs[i].Name]; fenced {
			outs[i].Mode = l.p.checkedMode(outs[i].Name, outs[i].Mode)
			if outs[i].Mode == ordered.ModeAtomic && outs[i].Slots == nil {
				outs[i].Slots = l.p.slots(outs[i].Name)
			}
		}
		if n < 3 && outs[i].Mode == ordered.ModeBatch {
			outs[i].Mode = ordered.ModeSingle
		}
	}
	w := l.in.NewWriter(outs, l.p.writerConfig())
	for i, o := range outs {
		if f, ok := l.fences[o.Name]; ok {
			w.SetFence(i, f.Subject, f.Seq)
		}
	}
	w.Probe()
	return w
}

// hooks are the lane's say in its writer's rounds of resends.
func (l *lane) hooks(ctx context.Context) ordered.Hooks {
	return ordered.Hooks{
		Allow: func(m *ordered.Msg) bool {
			var cost int64
			if e := l.entryOf(m); e != nil {
				cost = e.cost
			}
			if !l.clock.publish(cost) || errors.Is(context.Cause(ctx), ErrFenced) {
				return false
			}
			l.p.retries.Add(1)
			return true
		},
		Redirect: func(m *ordered.Msg) bool {
			e := l.entryOf(m)
			if e == nil {
				return true
			}
			reason, why := l.refusal(e)
			if reason == "" {
				return true // not about the message: sent again as it is
			}
			return l.refused(e, reason, why)
		},
		Round: func(first error, unsettled int, pause time.Duration) {
			// A resent message may now be stored after a later one of its device that was not
			// refused: look at every message in flight now as it leaves the queue.
			if len(l.q) > 0 {
				l.ro.until = max(l.ro.until, l.q[len(l.q)-1].seq)
			}
			l.p.warn("publish", func(ev *zerolog.Event) {
				ev.Int("partition", l.a.Partition).Err(first).Int("in_flight", unsettled).Int64("retry_in_ms", pause.Round(time.Millisecond).Milliseconds()).
					Msg("publish failed; resending in order (on a cluster this is expected for a few seconds while a stream elects its leader; if it persists, check that the OUTGOING and UNMAPPED streams exist and the servers are reachable)")
			})
		},
	}
}

// entryOf returns the lane's entry of a message of its writer (nil: none, which cannot be).
func (l *lane) entryOf(m *ordered.Msg) *entry {
	i, lo, hi := 0, 0, len(l.q)
	for lo < hi {
		i = int(uint(lo+hi) >> 1)
		switch {
		case l.q[i].seq < m.Key:
			lo = i + 1
		case l.q[i].seq > m.Key:
			hi = i
		default:
			return l.q[i]
		}
	}
	return nil
}

// recover waits until every publish in flight has settled, then resends, in stream order, every
// one that was not stored (package ordered). A message OUTGOING refuses for good (too large, not
// allowed) is dead-lettered instead. It returns ErrFenced when the lease's clock ran out or the
// writer was fenced, nil otherwise (also when ctx ended: the caller stops the lane).
func (l *lane) recover(ctx context.Context) error {
	err := l.w.Recover(ctx, l.hooks(ctx))
	switch {
	case errors.Is(err, ordered.ErrStopped), errors.Is(err, ordered.ErrFenced):
		return ErrFenced
	case err != nil:
		return err
	}
	return nil
}
