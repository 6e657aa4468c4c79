package lanes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// Parking holds the messages of a device that has no mapping in the PARKED stream, one subject
// per device (parked.<p>.<device>), and every later message of that device behind them, until
// the device gets a group; then a drain reads them back in order and republishes them to
// OUTGOING, and the device's live traffic follows. A park is a publish of the lane like any
// other: it goes through the same ordered, windowed queue, and the checkpoint moves when PARKED
// has stored it, so every INCOMING message ends up in OUTGOING, UNMAPPED or PARKED.
//
// The lane keeps its parked devices in memory (a map that is only looked at when it is not
// empty); a new owner rebuilds it at claim, after fencing, from PARKED's per-subject counts.
// The invariants the code keeps:
//   - a device is in the map from the moment a message of it is built as a park until a drain
//     has republished everything PARKED holds of it and nothing of it is in flight to PARKED;
//     while it is in the map every message of it is parked, whatever the groups table says;
//   - a drain republishes a device's parked messages in PARKED order, every one of them
//     acknowledged before the device leaves the map, so its live messages, published after,
//     are stored after them;
//   - purges remove only what a drain has seen acknowledged, so what a new owner finds in PARKED
//     is everything not yet republished, and a little that was (see park_drain.go).

// ParkConfig turns parking on; its zero value leaves it off.
type ParkConfig struct {
	// Stream is the PARKED stream (created by package setup). "" turns parking off: nothing is
	// parked, nothing released.
	Stream string
	// Prefix is the first token(s) of the parked subjects, "<Prefix>.<p>.<device>". Default
	// "parked".
	Prefix string
	// New parks a device whose lookup says [wire.ReasonNoMapping], or that its JSON value lacks a
	// field or has one the templates cannot use ([wire.ReasonMissingField],
	// [wire.ReasonInvalidField], [wire.ReasonInvalidValue]) (kvmapper run --on-unmapped park).
	// Without it a pool with Stream set still releases, expires and unparks what PARKED holds,
	// but parks no new device: its devices' order holds when parking is turned off.
	New bool
	// MaxAge dead-letters parked messages older than this, as [wire.ReasonParkExpired]. 0: never.
	MaxAge time.Duration
	// SweepInterval is how often a lane looks through its parked devices for one that has a
	// group (a release request it missed) or messages past MaxAge. Default 1s.
	SweepInterval time.Duration
	// Drains is how many of its parked devices a lane drains at once. Default 4.
	Drains int
	// PurgeInterval is how often a drain purges from PARKED what it has seen acknowledged; a
	// drain cut short resends what it had not purged yet. Default 250ms.
	PurgeInterval time.Duration
}

func (c *ParkConfig) setDefaults() error {
	if c.Stream == "" {
		return nil
	}
	c.Prefix = cmp.Or(c.Prefix, subjects.DefaultNames.ParkedPrefix)
	c.SweepInterval = cmp.Or(c.SweepInterval, time.Second)
	c.Drains = cmp.Or(c.Drains, 4)
	c.PurgeInterval = cmp.Or(c.PurgeInterval, 250*time.Millisecond)
	if c.MaxAge < 0 || c.SweepInterval < 0 || c.Drains < 0 || c.PurgeInterval < 0 {
		return fmt.Errorf("%w: Park.MaxAge, SweepInterval, Drains and PurgeInterval must not be negative", ErrInvalidConfig)
	}
	return nil
}

// parkedDevice is what a lane knows of one parked device.
type parkedDevice struct {
	name     string
	inFlight int    // parks of it not yet settled (in the lane's queue, or held)
	last     uint64 // the highest PARKED sequence this lane saw a park of it stored at
	count    int64  // its messages in PARKED, as far as the lane knows (for stats)
	// oldest is when its oldest message still parked was parked; zero when unknown (found in
	// PARKED at claim: a drain in expire mode reads it).
	oldest time.Time
	// inherited is set when PARKED held messages of it at claim: only a drain can tell what.
	inherited bool
	drain     *drain    // the drain running for it, or nil
	queued    drainMode // the drain it waits for, or 0
	// unpark is the drain an unpark.<p>.<device> key asked for, and unparkRev that key's
	// revision, deleted once the device is drained.
	unpark    drainMode
	unparkRev uint64
}

// parking is a lane's parking state. Everything but the fields marked otherwise belongs to the
// lane's goroutine.
type parking struct {
	cfg     *ParkConfig
	devices map[string]*parkedDevice
	queue   []*parkedDevice // waiting for a drain, in order; dev.queued says which
	drains  map[uint64]*drain
	nextID  uint64

	// events carries to the lane what its parking goroutines learn: drain starts and messages,
	// acknowledgements, purge results, unpark requests. Its senders give up when done is closed
	// (by the lane, when it stops); nobody closes events.
	events chan parkEvent
	done   chan struct{}
	wg     sync.WaitGroup  // every goroutine of parking
	gctx   context.Context // the goroutines' context: the lane's, cancelled when parking stops

	parked jetstream.Stream // opened at claim; nil when the stream was missing

	purges    map[string]uint64 // device → last PARKED sequence to purge up to, queued
	purgeList []string          // the order of purges
	purging   bool              // a purge is in flight
	lastSweep time.Time
	stopped   bool // stopParking ran

	// Release requests, from any goroutine (Pool.Release): guarded by mu, flagged by requested.
	mu        sync.Mutex
	pending   map[string]struct{}
	requested atomic.Bool

	nDevices, nMsgs atomic.Int64 // read by Pool.Stats
}

// parkEventKind tells what a parkEvent carries.
type parkEventKind uint8

const (
	evDrainStart parkEventKind = iota + 1 // a drain's reader read where the device stands
	evDrainMsg                            // a drain's reader read a parked message
	evPurged                              // a purge ended
	evUnpark                              // an unpark.<p>.<device> key was put
	evKeyDeleted                          // an unpark key was deleted (or that failed)
	evKick                                // a release was requested
)

type parkEvent struct {
	kind   parkEventKind
	drain  uint64 // the drain's id
	reader uint64 // the drain reader's generation
	msg    jetstream.Msg
	seq    uint64 // PARKED sequence of msg; the purge's last sequence
	at     time.Time
	l0     uint64 // the device's last PARKED sequence when the drain started
	device string
	mode   drainMode
	rev    uint64
	err    error
}

// newParking returns the parking state of a lane, or nil when parking is off.
func newParking(cfg *ParkConfig) *parking {
	if cfg.Stream == "" {
		return nil
	}
	return &parking{
		cfg:     cfg,
		devices: make(map[string]*parkedDevice),
		drains:  make(map[uint64]*drain),
		events:  make(chan parkEvent, 64),
		done:    make(chan struct{}),
		purges:  make(map[string]uint64),
		pending: make(map[string]struct{}),
	}
}

// send hands ev to the lane, or gives up when the lane stopped parking or ctx ended.
func (s *parking) send(ctx context.Context, ev parkEvent) bool {
	select {
	case s.events <- ev:
		return true
	case <-s.done:
		return false
	case <-ctx.Done():
		return false
	}
}

// request asks for device to be released if it is parked. It never blocks.
func (s *parking) request(device string) {
	s.mu.Lock()
	s.pending[device] = struct{}{}
	s.mu.Unlock()
	if !s.requested.Swap(true) {
		select {
		case s.events <- parkEvent{kind: evKick}:
		default: // the lane looks at requested on every event and tick anyway
		}
	}
}

// Release asks the lane of device's partition, if this pool runs it, to release device's parked
// messages now: the caller has seen it get a group (package kv's OnUpdate). It never blocks and
// is safe for concurrent use; a device that is not parked is ignored. A request that is missed
// (the lane was starting, say) is made up for by the lane's sweep.
func (p *Pool) Release(device string) {
	if p.cfg.Park.Stream == "" {
		return
	}
	part := subjects.Partition(device, p.cfg.Layout.Partitions)
	p.lanesMu.Lock()
	for l := range p.lanes {
		if l.a.Partition == part && l.park != nil && l.park.nDevices.Load() > 0 {
			l.park.request(device)
		}
	}
	p.lanesMu.Unlock()
}

// parkEvents is the channel the lane's loop reads parking events from: nil when parking is off.
func (l *lane) parkEvents() <-chan parkEvent {
	if l.park == nil {
		return nil
	}
	return l.park.events
}

// startParking rebuilds the lane's parked devices from PARKED, after fencing and before the lane
// reads anything: every device PARKED holds messages of for this partition is parked again. It
// retries until it succeeds or ctx ends. It starts the goroutines parking needs (the drains'
// acknowledgements and the watch of unpark keys) and returns the func that stops them, which
// waits for every goroutine of parking.
func (l *lane) startParking(ctx context.Context) (func(), error) {
	s := l.park
	if s == nil {
		return func() {}, nil
	}
	backoff := l.p.cfg.RetryBackoff
	for {
		err := l.rebuildParked(ctx)
		if err == nil {
			break
		}
		l.p.warn("park-rebuild", func(e *zerolog.Event) {
			e.Int("partition", l.a.Partition).Err(err).Str("stream", s.cfg.Stream).
				Msg("reading the parked devices failed; retrying (the partition waits: its parked devices must stay parked)")
		})
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("lanes: reading the parked devices of partition %d: %w", l.a.Partition, err)
		}
		backoff = min(2*backoff, l.p.cfg.MaxRetryBackoff)
	}
	gctx, cancel := context.WithCancel(ctx)
	s.gctx = gctx
	s.wg.Go(func() { l.watchUnpark(gctx) })
	var once sync.Once
	return func() {
		once.Do(func() {
			close(s.done)
			cancel()
			for _, d := range s.drains {
				d.stopReader()
			}
			s.wg.Wait()
		})
	}, nil
}

// rebuildParked reads PARKED's per-subject counts of the lane's partition into the map. A
// missing PARKED holds nothing: the lane starts with no parked device (parks then fail until
// the stream exists, as publishes to a missing OUTGOING do).
func (l *lane) rebuildParked(ctx context.Context) error {
	s := l.park
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ps, err := l.p.js.Stream(rctx, s.cfg.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		l.p.warn("park-missing", func(e *zerolog.Event) {
			e.Str("stream", s.cfg.Stream).Msg("the PARKED stream does not exist: nothing is parked (kvmapper setup --on-unmapped park creates it)")
		})
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening stream %s: %w", s.cfg.Stream, err)
	}
	info, err := ps.Info(rctx, jetstream.WithSubjectFilter(subjects.ParkedFilter(s.cfg.Prefix, l.a.Partition)))
	if err != nil {
		return fmt.Errorf("reading stream %s: %w", s.cfg.Stream, err)
	}
	s.parked = ps
	clear(s.devices)
	var msgs int64
	for subj, n := range info.State.Subjects {
		device, p, ok := subjects.ParkedDevice(s.cfg.Prefix, subj)
		if !ok || p != l.a.Partition || n == 0 {
			continue
		}
		s.devices[device] = &parkedDevice{name: device, count: int64(n), inherited: true}
		msgs += int64(n)
	}
	s.nDevices.Store(int64(len(s.devices)))
	s.nMsgs.Store(msgs)
	if len(s.devices) > 0 {
		l.log.Debug().Int("devices", len(s.devices)).Int64("messages", msgs).Msg("parked devices found in PARKED")
	}
	return nil
}

// parks tells whether the message of device being built must be parked: the device is parked
// already, or parking is on for new devices and it has no mapping, or a JSON value the
// templates cannot use (missing or invalid field, not JSON): those wait in PARKED until the
// value is fixed. A plain value that is not a valid group (invalid-group) is dead-lettered, as
// before values could be JSON. The hot path: a nil check when parking is off, one map lookup
// when some device is parked.
func (s *parking) parks(device, reason string) bool {
	if len(s.devices) > 0 {
		if _, ok := s.devices[device]; ok {
			return true
		}
	}
	if !s.cfg.New {
		return false
	}
	switch reason {
	case wire.ReasonNoMapping, wire.ReasonMissingField, wire.ReasonInvalidField, wire.ReasonInvalidValue:
		return true
	}
	return false
}

// parkEntry makes e, built from d with headers hdr, a park: published to the device's subject in
// PARKED with its stored INCOMING subject in [wire.HeaderSubject], its Nats-Msg-Id the one it would
// have in OUTGOING.
func (l *lane) parkEntry(e *entry, d delivery, hdr nats.Header) {
	s := l.park
	e.parked = true
	hdr[wire.HeaderSubject] = []string{d.msg.Subject()}
	delete(hdr, wire.HeaderProvenance)
	if !l.p.cfg.NoProvenance {
		hdr[wire.HeaderProvenance] = l.provDead
	}
	dev := s.devices[e.device]
	if dev == nil {
		dev = &parkedDevice{name: strings.Clone(e.device)}
		s.devices[dev.name] = dev
		s.nDevices.Store(int64(len(s.devices)))
	}
	e.device = dev.name
	e.m.Subject = subjects.ParkedSubject(s.cfg.Prefix, l.a.Partition, dev.name)
	dev.inFlight++
}

// parkSettled takes in a park that left the lane's queue: stored in PARKED (or found there as a
// duplicate), or dead-lettered instead (PARKED full, say).
func (l *lane) parkSettled(e *entry) {
	s := l.park
	dev := s.devices[e.device]
	if dev == nil {
		return
	}
	dev.inFlight--
	if e.reason == "" && e.om.Stored {
		dev.last = max(dev.last, e.om.Seq)
		if !e.om.Duplicate {
			if dev.count == 0 && dev.oldest.IsZero() && !dev.inherited {
				dev.oldest = time.Now()
			}
			dev.count++
			s.nMsgs.Add(1)
			l.p.parked.Add(1)
		}
	}
	if dev.drain != nil {
		l.drainCheck(dev.drain)
		return
	}
	if dev.inFlight == 0 && dev.last == 0 && !dev.inherited && dev.queued == 0 {
		l.unparkDevice(dev) // nothing of it was stored: not parked at all
	}
}

// unparkDevice removes dev from the parked devices: nothing of it is left to drain.
func (l *lane) unparkDevice(dev *parkedDevice) {
	s := l.park
	delete(s.devices, dev.name)
	s.nDevices.Store(int64(len(s.devices)))
	s.nMsgs.Add(-dev.count)
	dev.count = 0
	if dev.unparkRev != 0 {
		l.deleteUnparkKey(dev.name, dev.unparkRev)
	}
}

// parkRefusal is [permanent] for a park: PARKED refuses a message over its per-device or total
// limit with the generic "store failed" code (nats-server 2.15 JSStreamStoreFailedF, 10077, HTTP
// 503) and the store's words, which are the only way to tell those refusals from a store
// closing under a restart: those refusals are [wire.ReasonParkFull].
func parkRefusal(err error) (reason, why string) {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeStoreFailed {
		switch apiErr.Description {
		case storeMaxMsgsPerSubject, storeMaxMsgs, storeMaxBytes:
			return wire.ReasonParkFull, apiErr.Description
		}
	}
	return permanent(err)
}

// refusal is [permanent] for e, which may be a park.
func (l *lane) refusal(e *entry) (reason, why string) {
	if e.parked && e.reason == "" {
		return parkRefusal(e.om.Err)
	}
	return permanent(e.om.Err)
}

// The server's JSStreamStoreFailedF code and its store's errors for a discard-new limit
// (nats-server 2.15 store.go ErrMaxMsgsPerSubject, ErrMaxMsgs, ErrMaxBytes).
const (
	errCodeStoreFailed     jetstream.ErrorCode = 10077
	storeMaxMsgsPerSubject                     = "maximum messages per subject exceeded"
	storeMaxMsgs                               = "maximum messages exceeded"
	storeMaxBytes                              = "maximum bytes exceeded"
)

// parkHeld tells whether a drain waits for room in the pool's window.
func (l *lane) parkHeld() bool {
	if l.park == nil {
		return false
	}
	for _, d := range l.park.drains {
		if d.held != nil {
			return true
		}
	}
	return false
}

// parkEvent handles one parking event on the lane's goroutine.
func (l *lane) parkEvent(ctx context.Context, ev parkEvent) {
	s := l.park
	switch ev.kind {
	case evDrainStart:
		if d := s.drains[ev.drain]; d != nil && d.readerGen == ev.reader {
			d.started, d.l0 = true, ev.l0
			l.drainCheck(d)
		}
	case evDrainMsg:
		if d := s.drains[ev.drain]; d != nil && d.readerGen == ev.reader {
			l.drainMsg(d, ev.msg, ev.seq, ev.at)
		}
	case evPurged:
		l.purged(ev)
	case evUnpark:
		l.unparkRequest(ev.device, ev.mode, ev.rev)
	}
	l.parkStep(ctx)
}

// parkStep moves parking on: admits drains' held messages, takes release requests and starts
// queued drains. It runs after every parking event, window wake and tick.
func (l *lane) parkStep(ctx context.Context) {
	s := l.park
	if s == nil || s.stopped {
		return
	}
	for _, d := range s.drains {
		if d.held != nil {
			l.drainAdmit(d)
		}
	}
	if s.requested.Swap(false) {
		s.mu.Lock()
		pending := s.pending
		s.pending = make(map[string]struct{})
		s.mu.Unlock()
		for device := range pending {
			if dev := s.devices[device]; dev != nil && dev.drain == nil && dev.queued == 0 {
				if l.p.lookup(device).Mapped() {
					l.queueDrain(dev, drainRelease)
				}
			}
		}
	}
	l.startDrains(ctx)
}

// parkTick is the lane's tick for parking: drains' timeouts and restarts, purges, and every
// SweepInterval the sweep of parked devices.
func (l *lane) parkTick(ctx context.Context, now time.Time) {
	s := l.park
	if s == nil || s.stopped {
		return
	}
	for _, d := range s.drains {
		l.drainTick(ctx, d, now)
	}
	if now.Sub(s.lastSweep) >= s.cfg.SweepInterval {
		s.lastSweep = now
		l.sweep(now)
	}
	l.startPurge()
	l.parkStep(ctx)
}

// sweep queues a release for each parked device that has a group and is not drained yet (a
// release request may have come while the lane was starting, or been for a device parked a
// moment later), and an expiry for each whose oldest message is past MaxAge, or unknown.
func (l *lane) sweep(now time.Time) {
	s := l.park
	for name, dev := range s.devices {
		if dev.drain != nil || dev.queued != 0 {
			continue
		}
		if l.p.lookup(name).Mapped() {
			l.queueDrain(dev, drainRelease)
			continue
		}
		if s.cfg.MaxAge > 0 && (dev.last > 0 || dev.inherited) && (dev.oldest.IsZero() || now.Sub(dev.oldest) > s.cfg.MaxAge) {
			l.queueDrain(dev, drainExpire)
		}
	}
}

// queueDrain queues a drain of dev in mode; an unpark goes first.
func (l *lane) queueDrain(dev *parkedDevice, mode drainMode) {
	s := l.park
	dev.queued = mode
	if mode >= drainForce {
		s.queue = append([]*parkedDevice{dev}, s.queue...)
		return
	}
	s.queue = append(s.queue, dev)
}

// startDrains starts queued drains while fewer than Drains run.
func (l *lane) startDrains(ctx context.Context) {
	s := l.park
	for len(s.drains) < s.cfg.Drains && len(s.queue) > 0 && ctx.Err() == nil {
		dev := s.queue[0]
		s.queue[0] = nil
		s.queue = s.queue[1:]
		mode := dev.queued
		dev.queued = 0
		if s.devices[dev.name] != dev || dev.drain != nil || mode == 0 {
			continue // unparked, or drained meanwhile
		}
		if dev.unpark != 0 {
			mode = dev.unpark
		}
		l.startDrain(ctx, dev, mode)
	}
}
