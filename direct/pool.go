package direct

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/ratelog"
	"github.com/kvmapper/kvmapper/wire"
)

// HeaderMarker carries, on a handoff marker, which lane published it (see [Pool]).
const HeaderMarker = "KVMapper-Marker"

// markerDevice is the device token of handoff markers.
const markerDevice = "kvmapper-marker"

// Stats are counters of a pool's work since it was created.
type Stats struct {
	Mapped   uint64            // messages forwarded to OUTGOING
	Unmapped map[string]uint64 // messages forwarded to UNMAPPED, by reason
	// HandedOver counts messages a new owner received and did not forward because the previous
	// owner had forwarded them during the handoff.
	HandedOver uint64
	// Dropped counts messages that got no forward: their partition's queue was full, or the
	// publish failed on the connection (closed, reconnecting). Their publishers get no
	// acknowledgement and must retry.
	Dropped  uint64
	Failures uint64 // publishes that failed on the connection (each one is also Dropped)
	Pending  int    // messages waiting in the queues now
	// Lingering counts released partitions still forwarding until their next owner announces
	// itself.
	Lingering int
}

// PartitionStats describe one partition this pool owns.
type PartitionStats struct {
	Partition int
	Epoch     uint64
	Pending   int // messages waiting in its queue
}

// Pool forwards the partitions this replica owns: [Pool.Run] runs one, until its context ends,
// then hands it over. A partition has one goroutine, which takes its messages in the order the
// server delivered them, maps each with the latest group the lookup gives and publishes it, so a
// device's messages keep their order and a group change takes effect at one point in them (I4).
//
// A handoff works like this. When a partition's context is released, Run returns at once (so
// that the lease can be deleted and claimed) and the partition goes on forwarding, remembering
// the reply subject of each message it forwards. Its next owner subscribes, then announces itself
// on <HandoffPrefix>.<p> and holds what it receives. The old owner, on the announcement, publishes
// a marker on its own subscription and forwards everything before it, and for HandoffSettle more;
// then it unsubscribes and answers with the reply subjects it forwarded since the release (with
// wire.ReceiveAll, since HandoffSettle before it: each replica's subscription delivers on its own
// schedule, and a new owner, fed from a start marker of its own, may hold a message the old one
// forwarded just before). The new owner forwards what it
// held except those, then everything after. A js.Publish has a reply subject of its own, so every
// message is forwarded once, in order, and none waits for an owner. A message without a reply
// subject cannot be told apart: one that arrives while both hold the partition is forwarded by
// both. Nobody answering an announcement (no responders) means there is no previous owner.
// Its methods are safe for concurrent use.
type Pool struct {
	nc     *nats.Conn
	lookup LookupFunc
	cfg    Config
	log    zerolog.Logger
	shape  shape
	// markerSubject is what a handoff marker is published to with wire.ReceiveAll; with
	// wire.ReceiveMapping the partition's own form of it ([shape.stored]).
	markerSubject string

	mapped, handedOver, dropped, failures atomic.Uint64
	unmappedMu                            sync.Mutex
	unmapped                              map[string]uint64
	nonces                                atomic.Uint64

	mu        sync.Mutex // guards lanes, closed, shared and routes' writers
	lanes     map[*lane]struct{}
	closed    bool
	shared    *nats.Subscription // ReceiveAll: every device subject, feeding dispatch
	routes    atomic.Pointer[routes]
	lingering atomic.Int64
	wg        sync.WaitGroup // the lanes' goroutines

	warns ratelog.Limiter
}

// New returns a pool that receives and publishes on nc and maps devices with lookup. It does no
// I/O. nc should use nats.ReconnectBufSize(-1), so that a forward made while disconnected fails
// at once (and is counted) instead of being sent late, out of order with what came after it.
func New(nc *nats.Conn, lookup LookupFunc, cfg Config) (*Pool, error) {
	if nc == nil || lookup == nil {
		return nil, fmt.Errorf("%w: connection and lookup are required", ErrInvalidConfig)
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	cfg.QueueBytes = max(cfg.QueueBytes, nc.MaxPayload()+8<<10)
	p := &Pool{
		nc:       nc,
		lookup:   lookup,
		cfg:      cfg,
		log:      cfg.Logger,
		shape:    newShape(cfg.Layout),
		unmapped: make(map[string]uint64),
		lanes:    make(map[*lane]struct{}),
	}
	values := map[string]string{}
	for _, name := range cfg.Layout.In.Placeholders() {
		values[name] = "marker"
	}
	values["device"] = markerDevice
	var err error
	if p.markerSubject, err = cfg.Layout.In.Render(values); err != nil {
		return nil, fmt.Errorf("%w: rendering the marker subject: %w", ErrInvalidConfig, err)
	}
	p.routes.Store(&routes{byPartition: make([][]*lane, cfg.Layout.Partitions)})
	return p, nil
}

// Run serves partition a.Partition until ctx is done or the lease's clock runs out. It first
// takes the partition over from its previous owner, if one is still forwarding it (see [Pool]).
// When ctx ends with a cause wrapping [ErrFenced] the partition stops at once; any other end of
// ctx is a release: Run returns at once and the partition goes on forwarding, on a goroutine of
// the pool, until its next owner has taken it over or HandoffTimeout has passed. A partition
// released while it is still taking over first finishes that (for up to HandoffTimeout more),
// so that Run returns only once the partition forwards what its previous owner left to it. Run returns nil
// when ctx ended it, [ErrFenced] when it found itself deposed, [ErrClosed] after Close, or an
// error subscribing.
func (p *Pool) Run(ctx context.Context, a Assignment) error {
	if a.Partition < 0 || a.Partition >= p.cfg.Layout.Partitions {
		return fmt.Errorf("%w: partition %d outside 0..%d", ErrInvalidConfig, a.Partition, p.cfg.Layout.Partitions-1)
	}
	l := newLane(p, a)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.lanes[l] = struct{}{}
	p.wg.Add(1)
	p.mu.Unlock()
	go func() {
		defer p.wg.Done()
		defer p.forget(l)
		l.run(ctx)
	}()
	<-l.detached
	return l.err
}

// Close waits for the partitions still handing over (at most [Pool.CloseTimeout]), then stops
// receiving. Call it once every Run has returned; Run fails with [ErrClosed] after it.
// It is idempotent.
func (p *Pool) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.wg.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shared != nil {
		_ = p.shared.Unsubscribe()
		p.shared = nil
	}
}

// CloseTimeout returns the longest [Pool.Close] waits for a partition whose Run has returned: it
// asks whether another replica is left to hand it to (AnswerTimeout), forwards until its next
// owner announces itself (HandoffTimeout), then waits for its handoff marker (AnswerTimeout),
// settles (HandoffSettle) and flushes its answer (AnswerTimeout). A supervisor's grace period
// for a stopping replica must cover it beyond the wait for Run.
func (p *Pool) CloseTimeout() time.Duration {
	return 3*p.cfg.AnswerTimeout + p.cfg.HandoffTimeout + p.cfg.HandoffSettle
}

func (p *Pool) forget(l *lane) {
	p.mu.Lock()
	delete(p.lanes, l)
	p.mu.Unlock()
}

// subscribeShared makes sure the shared subscription of [wire.ReceiveAll] is in place, and that the
// server has it, before a lane relies on it.
func (p *Pool) subscribeShared() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shared != nil {
		return nil
	}
	sub, err := p.nc.Subscribe(p.cfg.Layout.StreamSubject(), p.dispatch)
	if err != nil {
		return fmt.Errorf("direct: subscribing to %s: %w", p.cfg.Layout.StreamSubject(), err)
	}
	// dispatch never blocks: the bounds that matter are the lanes' queues.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		_ = sub.Unsubscribe()
		return fmt.Errorf("direct: subscribing to %s: %w", p.cfg.Layout.StreamSubject(), err)
	}
	if err := p.nc.Flush(); err != nil {
		_ = sub.Unsubscribe()
		return fmt.Errorf("direct: subscribing to %s: %w", p.cfg.Layout.StreamSubject(), err)
	}
	p.shared = sub
	return nil
}

// route changes what dispatch does for lane l: feed it its partition's messages or not, and route
// the marker value marker to it ("" for none). A lane routed a marker but not fed is fed from the
// moment dispatch meets that marker (see lane.subscribe).
func (p *Pool) route(l *lane, feed bool, marker string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := p.routes.Load()
	rt := &routes{byPartition: slices.Clone(old.byPartition), markers: make(map[string]*lane, len(old.markers)+1)}
	for k, v := range old.markers {
		if v != l {
			rt.markers[k] = v
		}
	}
	part := l.a.Partition
	ls := slices.DeleteFunc(slices.Clone(rt.byPartition[part]), func(x *lane) bool { return x == l })
	if feed {
		ls = append(ls, l)
	}
	if marker != "" {
		rt.markers[marker] = l
	}
	rt.byPartition[part] = ls
	p.routes.Store(rt)
}

// Partitions returns the partitions this pool serves now (not those handing over), by partition.
func (p *Pool) Partitions() []PartitionStats {
	p.mu.Lock()
	out := make([]PartitionStats, 0, len(p.lanes))
	for l := range p.lanes {
		if l.live.Load() {
			out = append(out, PartitionStats{Partition: l.a.Partition, Epoch: l.a.Epoch, Pending: l.q.len()})
		}
	}
	p.mu.Unlock()
	slices.SortFunc(out, func(a, b PartitionStats) int { return a.Partition - b.Partition })
	return out
}

// Stats returns the pool's counters.
func (p *Pool) Stats() Stats {
	s := Stats{
		Mapped:     p.mapped.Load(),
		HandedOver: p.handedOver.Load(),
		Dropped:    p.dropped.Load(),
		Failures:   p.failures.Load(),
		Lingering:  int(p.lingering.Load()),
		Unmapped:   make(map[string]uint64),
	}
	p.mu.Lock()
	for l := range p.lanes {
		s.Pending += l.q.len()
	}
	p.mu.Unlock()
	p.unmappedMu.Lock()
	for k, v := range p.unmapped {
		s.Unmapped[k] = v
	}
	p.unmappedMu.Unlock()
	return s
}

func (p *Pool) countUnmapped(reason string) {
	p.unmappedMu.Lock()
	p.unmapped[reason]++
	p.unmappedMu.Unlock()
}

// handoffSubject is where the new owners of partition part announce themselves.
func (p *Pool) handoffSubject(part int) string {
	return p.cfg.HandoffPrefix + "." + strconv.Itoa(part)
}

// nonce returns a value no other marker or announcement of this deployment carries.
func (p *Pool) nonce(a Assignment) string {
	return p.cfg.Replica + "." + strconv.FormatUint(a.Epoch, 10) + "." + strconv.FormatUint(p.nonces.Add(1), 10)
}

// warn logs at most one line per second per kind of problem, with the number it left out (I6).
func (p *Pool) warn(kind string, f func(e *zerolog.Event)) {
	skipped, ok := p.warns.Allow(kind)
	if !ok {
		return
	}
	e := p.log.Warn()
	if skipped > 0 {
		e = e.Int("suppressed", skipped)
	}
	f(e)
}

// subjectsFor returns what a lane of partition part subscribes to, and its marker subject.
func (p *Pool) subjectsFor(part int) (data, marker string) {
	if p.cfg.Receive == wire.ReceiveAll {
		return p.cfg.Layout.StreamSubject(), p.markerSubject
	}
	return p.cfg.Layout.Filter(part), p.shape.stored(p.markerSubject, part)
}

// markerSubjectFor is where lane l publishes its handoff marker so that it arrives on l's own
// subscription: the partition's marker subject, or, with wire.ReceiveAll, the one dispatch routes by
// the marker's value.
func (p *Pool) markerSubjectFor(l *lane) string {
	if p.cfg.Receive == wire.ReceiveAll {
		return p.markerSubject
	}
	return l.markerSubject
}
