package lanes

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/ratelog"
	"github.com/kvmapper/kvmapper/subjects"
)

// LookupFunc returns what device maps with: the values of its KV value that the layout's
// templates render (decoded with Config.Layout's schema) and that value's revision, or a reason
// ([wire.ReasonNoMapping], one of [wire.ValueReasons]) when the device cannot be mapped. It is
// called once per message from every lane at once: it must be safe for concurrent use and must
// not block.
type LookupFunc func(device string) subjects.Mapping

// Assignment is one partition handed to a lane by its owner.
type Assignment struct {
	Partition int
	// Epoch is the owner's fencing token (the lease revision); it is stamped on every message.
	Epoch uint64
	// Valid reports whether the lease still holds by the owner's own clock. The lane checks it
	// before every publish and stops when it turns false. nil means the lease never runs out.
	Valid func() bool
	// Owner is the replica id that holds the lease, written in the lane's fence records.
	Owner string
	// Fence are output streams the lane must fence whatever Config.Fences says: those the
	// owner it took over from vouched for (election.Lease.Checked), judged dead before its lease
	// expired. A stream it cannot fence ends the lane ([ErrFenceWrite]).
	Fence []string
}

// Config tunes a [Pool]. Zero fields mean the defaults given.
type Config struct {
	// Layout gives the subject templates and the partition count. Required.
	Layout *subjects.Layout
	// Incoming is the INCOMING stream's name, also the prefix of every Nats-Msg-Id. Default
	// "INCOMING". With the PartitionStreams layout it names the partition streams, INCOMING-<p>,
	// and each partition's Nats-Msg-Ids start with its stream's name.
	Incoming string
	// StreamLayout says how INCOMING is stored. With subjects.SingleStream (the default) a lane
	// reads INCOMING filtered on its partition; with subjects.PartitionStreams it reads its
	// partition's stream, INCOMING-<p>, unfiltered.
	StreamLayout subjects.StreamLayout
	// Outgoing and Unmapped name the output streams (defaults "OUTGOING", "UNMAPPED"): the
	// lanes read their configurations to choose how to write them (see Singles), and follow
	// their leader changes (leaders.go): a publish a stepping-down leader dropped is resent at
	// once, not after StallTimeout.
	Outgoing, Unmapped string
	// Singles writes every output stream with single publishes, as kvmapper did before it wrote
	// in batches. By default a replicated stream that allows atomic batches is written in atomic
	// batches, one that allows fast-ingest batches (allow_batched) in those, and any other with
	// single publishes: only batches keep a device's order through a leader change of the stream.
	Singles bool
	// MaxOpenBatches bounds the atomic batches a pool's lanes hold open on one stream at once
	// (the server refuses more than 50 per stream by default, from every writer together).
	// Default 16.
	MaxOpenBatches int
	// MaxInFlight bounds the unacknowledged publishes of all lanes of the pool together (I5).
	// Each partition is guaranteed a quarter of an even split of it, which no other lane can
	// take; the rest goes to the lanes that have work (see [Pool]). Default 4096, far below the
	// server's per-stream ingest queue (100k); at least the partition count, at most 50000.
	MaxInFlight int
	// MaxInFlightBytes bounds the bytes of those publishes (subject, reply, headers and payload
	// as sent), shared the same way. A lane with nothing in flight may always send one message:
	// with messages larger than MaxInFlightBytes / (4 × partitions), the bytes in flight can
	// exceed the bound by one message per lane. Default 64 MiB.
	MaxInFlightBytes int64
	// CheckpointInterval is how often a lane writes its acknowledged prefix. Default 100ms.
	CheckpointInterval time.Duration
	// PublishTimeout is how long a publish may wait for its acknowledgement. Default 5s.
	PublishTimeout time.Duration
	// StallTimeout is how long a lane waits with publishes in flight and no answer at all from
	// the server before it takes every publish in flight for lost and resends them in order,
	// first one alone. A stream whose leader died answers nothing until it has a new one and then
	// stores whatever comes next: without this, what the lane sent after the lost messages would
	// be stored first. nats-server 2.15 elects the new leader at the earliest 3s after the old
	// one's death (a 4–9s election timeout from a heartbeat at most 1s old), so the lane stops
	// sending before. Default 2s, which a healthy but loaded cluster seldom outlasts; negative
	// turns it off.
	StallTimeout time.Duration
	// DrainTimeout bounds how long a stopping lane waits for its in-flight publishes. Default 10s.
	DrainTimeout time.Duration
	// Heartbeat is the ordered consumer's idle heartbeat: a dead server is noticed after about
	// twice this. Default 1s.
	Heartbeat time.Duration
	// PullBatch is how many messages a lane's consumer asks for at once; it asks again when it
	// has handed them all on, so it holds at most this many. Default 512.
	PullBatch int
	// PullMaxBytes bounds the bytes of what a lane's consumer asks for at once, as PullBatch
	// bounds the messages, and the bytes it has handed on that the lane has not taken yet (at
	// most 64 messages wait there). Counted are subject, reply, headers and payload. It is
	// raised to the connection's maximum payload plus 8 KiB when lower: a message larger than
	// a pull request would stall the partition. Default 2 MiB.
	PullMaxBytes int
	// RetryBackoff is the first pause before republishing after a failure; it doubles up to
	// MaxRetryBackoff. Defaults 50ms and 2s.
	RetryBackoff, MaxRetryBackoff time.Duration
	// MaxCheckpointAge is how long a lane keeps taking new messages while its checkpoint cannot
	// be written. It must stay well below OUTGOING's duplicate window (2 minutes by default): a
	// takeover resends from the checkpoint, and only the window makes those resends duplicates.
	// Default 1m.
	MaxCheckpointAge time.Duration
	// IncarnationCheck is how often a pool reads INCOMING's creation time, to notice a stream
	// deleted and created again even when nothing is delivered from it (one request per pool
	// per interval). Default 2s.
	IncarnationCheck time.Duration
	// Fences are the output streams in which a lane writes its partition's fence record
	// (subjects.FenceSubject, wire.FenceRecord) when it takes the partition over, before it
	// writes anything to them: the streams setup recorded under wire.FenceKey. Empty: none.
	Fences []string
	// RefreshFences, when set, reads the fenced streams again (the control bucket's record of
	// them, which setup writes and may drop): the pool calls it when it reads the streams'
	// modes, every 10 s, and fences what it returns from then on. An error keeps what was read
	// last.
	RefreshFences func(ctx context.Context) ([]string, error)
	// Unfenced is a drill: the lanes write no fence records and check no fence, as a kvmapper
	// from before the output fences does, so that a test (or a game day) can run the replicas of
	// a rolling upgrade across the fencing change with one build. Never in production: a replica
	// taken over while it still writes would write beside its successor until its lease clock
	// runs out.
	Unfenced bool
	// FenceTimeout bounds how long a lane tries to write a fence record that gets no answer
	// (its stream without a leader, or unreachable) before it gives the partition up with
	// [ErrFenceWrite]; a record the stream refuses for good gives it up at once. Default 30s.
	FenceTimeout time.Duration
	// WaitWarnAfter is how long a lane waits (for a publish's answer, for its consumer to
	// deliver what its stream holds, for room in the window, for a checkpoint write) before it
	// logs what it waits for and shows it in [PartitionStats.Waiting] (see wait.go); a consumer
	// that delivers nothing is replaced then. Default 3s.
	WaitWarnAfter time.Duration
	// NoProvenance turns off the KVMapper-Prov header (partition, epoch, revision).
	NoProvenance bool
	// Park holds devices without a mapping in the PARKED stream until they get one (see
	// [ParkConfig]); its zero value turns parking off.
	Park ParkConfig
	// Logger receives structured logs. Default: none.
	Logger zerolog.Logger
}

func (c *Config) setDefaults() error {
	if c.Layout == nil {
		return fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	if c.Incoming == "" {
		c.Incoming = subjects.DefaultNames.Incoming
	}
	sl, err := subjects.ParseStreamLayout(string(c.StreamLayout))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	c.StreamLayout = sl
	c.Outgoing = cmp.Or(c.Outgoing, subjects.DefaultNames.Outgoing)
	c.Unmapped = cmp.Or(c.Unmapped, subjects.DefaultNames.Unmapped)
	c.MaxOpenBatches = cmp.Or(c.MaxOpenBatches, 16)
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 4096
	}
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = 64 << 20
	}
	if c.PullMaxBytes == 0 {
		c.PullMaxBytes = 2 << 20
	}
	if c.CheckpointInterval == 0 {
		c.CheckpointInterval = 100 * time.Millisecond
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = 5 * time.Second
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = 2 * time.Second
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = 10 * time.Second
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = time.Second
	}
	if c.PullBatch == 0 {
		c.PullBatch = 512
	}
	if c.MaxCheckpointAge == 0 {
		c.MaxCheckpointAge = time.Minute
	}
	c.FenceTimeout = cmp.Or(c.FenceTimeout, 30*time.Second)
	c.WaitWarnAfter = cmp.Or(c.WaitWarnAfter, 3*time.Second)
	if c.IncarnationCheck == 0 {
		c.IncarnationCheck = 2 * time.Second
	}
	if c.RetryBackoff == 0 {
		c.RetryBackoff = 50 * time.Millisecond
	}
	if err := c.Park.setDefaults(); err != nil {
		return err
	}
	if c.MaxRetryBackoff == 0 {
		c.MaxRetryBackoff = 2 * time.Second
	}
	switch {
	case c.MaxInFlight < c.Layout.Partitions:
		return fmt.Errorf("%w: MaxInFlight %d must be at least the partition count %d (one publish per partition)", ErrInvalidConfig, c.MaxInFlight, c.Layout.Partitions)
	case c.MaxInFlight > maxWindow:
		return fmt.Errorf("%w: MaxInFlight %d must stay far below the server's ingest queue (100k); use at most %d", ErrInvalidConfig, c.MaxInFlight, maxWindow)
	case c.MaxInFlightBytes < 0, c.PullMaxBytes < 0, c.PullBatch < 0:
		return fmt.Errorf("%w: MaxInFlightBytes, PullMaxBytes and PullBatch must be positive", ErrInvalidConfig)
	case c.CheckpointInterval < 0, c.PublishTimeout < 0, c.IncarnationCheck < 0, c.DrainTimeout < 0, c.Heartbeat < 0, c.RetryBackoff < 0:
		return fmt.Errorf("%w: durations must be positive", ErrInvalidConfig)
	}
	return nil
}

// Stats are counters of a pool's work since it was created.
type Stats struct {
	Mapped     uint64            // messages acknowledged by OUTGOING as new
	Unmapped   map[string]uint64 // messages acknowledged by UNMAPPED, by reason
	Duplicates uint64            // publishes OUTGOING or UNMAPPED acknowledged as duplicates
	Retries    uint64            // messages republished after a publish failure
	Failures   uint64            // publish failures (each one is retried or dead-lettered)
	Dropped    uint64            // dead letters UNMAPPED refused even stripped: left in INCOMING, logged
	Reorders   uint64            // messages this pool stored after a later one of their device (I1)
	InFlight   int               // publishes awaiting acknowledgement now
	// InFlightBytes is the size on the wire of the publishes awaiting acknowledgement now.
	InFlightBytes int64
	// Parked counts messages PARKED stored; Released those of them republished to OUTGOING
	// (also counted in Mapped). Dead letters from the park count in Unmapped by reason.
	Parked, Released uint64
	// ParkedDevices and ParkedMessages are what the running lanes hold parked now, as far as
	// they know (PARKED itself is the record: see package status).
	ParkedDevices, ParkedMessages int64
}

// Pool runs lanes: one per owned partition, sharing one bound on the publishes in flight, in
// messages and in bytes (I5). Each partition is guaranteed a quarter of an even split of the
// bound, whether its lane runs or not, and no other lane can take it: a lane whose publishes go
// unanswered keeps what it holds through every retry, and must not stall the others. The rest
// is shared, so a lone busy lane gets all but the other partitions' guarantees (about three
// quarters of the bound), and a lane holding an even share of the running lanes or more takes
// nothing more while another lane waits for room.
// Its methods are safe for concurrent use.
type Pool struct {
	js     jetstream.JetStream // consumers
	nc     *nats.Conn
	ctl    jetstream.KeyValue
	lookup LookupFunc
	cfg    Config
	log    zerolog.Logger

	window    *window // the publishes in flight, shared by all lanes (I5)
	modes     writeModes
	pullBytes int // PullMaxBytes, raised to what the largest message needs

	mapped, duplicates, retries, failures atomic.Uint64
	dropped, reorders                     atomic.Uint64
	parked, released                      atomic.Uint64
	unmappedMu                            sync.Mutex
	unmapped                              map[string]uint64

	lanesMu sync.Mutex
	lanes   map[*lane]struct{}

	incMu   sync.Mutex // serialises the reads of the incarnations; guards incs and control
	incs    map[string]incarnation
	control string // the control bucket's incarnation, once read (see outfence.go)

	leaders leaders // when each stream's latest leader was announced (see leaders.go)
	stopMu  sync.Mutex
	stops   map[string]time.Time // servers that said they are shutting down, and when

	warns ratelog.Limiter // one line a second per kind of problem
}

// New returns a pool that consumes and publishes with js, writes checkpoints to the control
// bucket ctl and maps devices with lookup. The connection js was made on should use
// nats.ReconnectBufSize(-1), so that nothing published while reconnecting is sent behind a
// message that failed: the pool relies on it to keep order across reconnects.
func New(js jetstream.JetStream, ctl jetstream.KeyValue, lookup LookupFunc, cfg Config) (*Pool, error) {
	if js == nil || ctl == nil || lookup == nil {
		return nil, fmt.Errorf("%w: js, control bucket and lookup are required", ErrInvalidConfig)
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	nc := js.Conn()
	return &Pool{
		js:        js,
		nc:        nc,
		ctl:       ctl,
		lookup:    lookup,
		cfg:       cfg,
		log:       cfg.Logger,
		window:    newWindow(int64(cfg.MaxInFlight), cfg.MaxInFlightBytes, cfg.Layout.Partitions),
		pullBytes: max(cfg.PullMaxBytes, int(nc.MaxPayload())+8<<10),
		unmapped:  make(map[string]uint64),
		lanes:     make(map[*lane]struct{}),
		incs:      make(map[string]incarnation),
	}, nil
}

// Run runs the lane of one partition until ctx is done, the lease's clock runs out or another
// owner fences it. On the way out it stops reading, waits for its in-flight publishes (up to
// DrainTimeout) and writes the final checkpoint, so the next owner starts exactly after the
// last acknowledged message. It returns nil when ctx ended it, [ErrFenced] when it lost the
// partition, or another error it could not recover from.
func (p *Pool) Run(ctx context.Context, a Assignment) error {
	if a.Partition < 0 || a.Partition >= p.cfg.Layout.Partitions {
		return fmt.Errorf("%w: partition %d outside 0..%d", ErrInvalidConfig, a.Partition, p.cfg.Layout.Partitions-1)
	}
	l := newLane(p, a)
	return l.run(ctx)
}

// PartitionStats describe one running lane.
type PartitionStats struct {
	Partition  int
	Epoch      uint64
	Acked      uint64 // last INCOMING sequence of the contiguous acknowledged prefix
	Checkpoint uint64 // last sequence written to checkpoint.<p>
	Pending    uint64 // messages of the partition in INCOMING not yet delivered to the lane
	InFlight   int    // publishes awaiting acknowledgement
	// ParkedDevices and ParkedMessages are what the lane holds parked now, as far as it knows.
	ParkedDevices, ParkedMessages int64
	// Waiting is what the lane has waited for longer than Config.WaitWarnAfter, nil when it
	// has not (see wait.go).
	Waiting *Wait
}

// Lag is how many messages of the partition are not yet acknowledged by OUTGOING or UNMAPPED.
func (s PartitionStats) Lag() uint64 { return s.Pending + uint64(s.InFlight) }

// Partitions returns the stats of every lane running now, by partition.
func (p *Pool) Partitions() []PartitionStats {
	p.lanesMu.Lock()
	out := make([]PartitionStats, 0, len(p.lanes))
	for l := range p.lanes {
		out = append(out, PartitionStats{
			Partition:  l.a.Partition,
			Epoch:      l.a.Epoch,
			Acked:      l.stats.acked.Load(),
			Checkpoint: l.stats.checkpoint.Load(),
			Pending:    l.stats.pending.Load(),
			InFlight:   int(l.stats.inFlight.Load()),
			Waiting:    l.stats.w.wait.Load(),
		})
		if l.park != nil {
			out[len(out)-1].ParkedDevices, out[len(out)-1].ParkedMessages = l.park.nDevices.Load(), l.park.nMsgs.Load()
		}
	}
	p.lanesMu.Unlock()
	slices.SortFunc(out, func(a, b PartitionStats) int { return a.Partition - b.Partition })
	return out
}

func (p *Pool) register(l *lane) {
	p.leaders.start(p.nc)
	p.window.register()
	p.lanesMu.Lock()
	p.lanes[l] = struct{}{}
	p.lanesMu.Unlock()
}

func (p *Pool) unregister(l *lane) {
	p.lanesMu.Lock()
	delete(p.lanes, l)
	p.lanesMu.Unlock()
	p.window.unregister(&l.grant)
	p.leaders.stop()
}

// DrainTimeout returns how long a stopping lane may wait for its in-flight publishes.
func (p *Pool) DrainTimeout() time.Duration { return p.cfg.DrainTimeout }

// Stats returns the pool's counters.
func (p *Pool) Stats() Stats {
	s := Stats{
		Mapped:     p.mapped.Load(),
		Duplicates: p.duplicates.Load(),
		Retries:    p.retries.Load(),
		Failures:   p.failures.Load(),
		Dropped:    p.dropped.Load(),
		Reorders:   p.reorders.Load(),
		Parked:     p.parked.Load(),
		Released:   p.released.Load(),
		Unmapped:   make(map[string]uint64),
	}
	p.lanesMu.Lock()
	for l := range p.lanes {
		if l.park != nil {
			s.ParkedDevices += l.park.nDevices.Load()
			s.ParkedMessages += l.park.nMsgs.Load()
		}
	}
	p.lanesMu.Unlock()
	msgs, bytes := p.window.inFlight()
	s.InFlight, s.InFlightBytes = int(msgs), bytes
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

// warn logs at most one line per second per kind of problem, with the number it left out, so a
// flood of bad input cannot flood the log (I6).
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
