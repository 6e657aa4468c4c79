package metrics

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/rs/zerolog"
)

// ErrInvalidConfig is wrapped by the error [New] returns for an unusable argument.
var ErrInvalidConfig = errors.New("metrics: invalid config")

// Snapshot is a replica's state at one scrape, as returned by a [Source]. Counters only grow
// over the life of the replica.
type Snapshot struct {
	Mapped     uint64            // messages OUTGOING acknowledged as new
	Unmapped   map[string]uint64 // messages UNMAPPED acknowledged, by reason
	Duplicates uint64            // publishes acknowledged as duplicates
	Retries    uint64            // messages republished after a failure
	Failures   uint64            // publish failures
	Dropped    uint64            // dead letters UNMAPPED refused even stripped
	Reorders   uint64            // messages this replica stored after a later one of their device
	InFlight   int               // publishes awaiting acknowledgement now

	Parked         uint64 // messages parked in PARKED
	Released       uint64 // parked messages republished to OUTGOING
	ParkedDevices  int64  // devices this replica's lanes hold parked now
	ParkedMessages int64  // messages they hold parked

	Owned      int         // partitions this replica holds a lease for
	Partitions []Partition // the partitions whose lane is running now

	TableDevices  int    // devices in the in-memory groups table
	TableRevision uint64 // groups bucket revision the table has applied
	// WatchLag is how many revisions the groups bucket holds beyond TableRevision; negative
	// when unknown (the bucket could not be asked), and then not exported.
	WatchLag int64

	EventsPublished uint64 // ownership events published
	EventsDropped   uint64 // ownership events dropped because the publisher fell behind

	// WatchRestarts counts the control bucket watches the replica replaced because they stopped
	// showing its own writes (election.Elector.WatchStalls).
	WatchRestarts uint64

	// LeaseTTL is the partition lease TTL the replica runs with; 0: not exported.
	LeaseTTL time.Duration
	// Streams are the streams and buckets the replica uses, with their leaders and followers.
	Streams []Stream
	// WriteModes say how the replica writes each output stream now: "atomic", "batch" (fast
	// ingest) or "single" (package ordered).
	WriteModes map[string]string
}

// Stream is how one stream (or a bucket's stream) is replicated, as its info says.
type Stream struct {
	Name      string
	Replicas  int    // replica count configured; 0 when its info could not be read
	Leader    string // server leading it; "" when none does or its info could not be read
	Followers []Follower
}

// Follower is one replica of a stream other than its leader.
type Follower struct {
	Server  string
	Current bool          // it has everything the leader has
	Lag     uint64        // operations behind the leader
	SeenAgo time.Duration // since the leader last heard from it
}

// Partition is one running lane's progress.
type Partition struct {
	Partition  int
	Epoch      uint64 // lease revision at claim (fencing token)
	Acked      uint64 // last INCOMING sequence of the contiguous acknowledged prefix
	Checkpoint uint64 // last sequence written to checkpoint.<p>
	Lag        uint64 // messages of the partition not yet acknowledged downstream
	// Waiting is how long the lane has waited for a publish's answer, its consumer, room in
	// the window or a checkpoint write, once past a few seconds (lanes.Wait); 0 otherwise.
	Waiting time.Duration
}

// Source returns the replica's state at scrape time. It is called once per scrape, from the
// scraping goroutine, with a context bounded by [Config.ScrapeTimeout]; it must be safe for
// concurrent use.
type Source func(ctx context.Context) Snapshot

// Config tunes [Metrics]. Zero fields mean the defaults given.
type Config struct {
	// Replica and Version label kvmapper_build_info.
	Replica, Version string
	// UnmappedReasons are exported as kvmapper_unmapped_total{reason} at zero before the first
	// message with that reason, so that rate() and alerts see the series from the start.
	UnmappedReasons []string
	// Ready reports whether the replica can serve: nil when ready, else an error saying why not
	// (the body of a 503 from /readyz). nil Ready means always ready.
	Ready func() error
	// GapBuckets are the bucket bounds, in seconds, of kvmapper_unowned_gap_seconds.
	// Default: 0.05s to about 51s in powers of two.
	GapBuckets []float64
	// ScrapeTimeout bounds the Source call of one scrape. Default 2s.
	ScrapeTimeout time.Duration
	// Partitions is the deployment's partition count, exported as kvmapper_partitions_configured
	// so that an alert can compare it with the leases held (the sum of kvmapper_partitions_owned)
	// even when no partition has ever been claimed. 0: not exported.
	Partitions int
	// Logger receives HTTP server errors. Default: none.
	Logger zerolog.Logger
}

// Metrics holds one replica's Prometheus registry. Its methods are safe for concurrent use.
type Metrics struct {
	cfg Config
	src Source
	reg *prometheus.Registry
	log zerolog.Logger

	changes      *prometheus.CounterVec
	gap          prometheus.Histogram
	tableUpdates *prometheus.CounterVec
	fenced       prometheus.Counter
	fenceFails   prometheus.Counter
}

// New returns Metrics that read src at every scrape. It registers the Go runtime and process
// collectors too. It does no I/O.
func New(src Source, cfg Config) (*Metrics, error) {
	if src == nil {
		return nil, fmt.Errorf("%w: nil source", ErrInvalidConfig)
	}
	if cfg.GapBuckets == nil {
		cfg.GapBuckets = prometheus.ExponentialBuckets(0.05, 2, 11)
	}
	if cfg.ScrapeTimeout == 0 {
		cfg.ScrapeTimeout = 2 * time.Second
	}
	if cfg.ScrapeTimeout < 0 {
		return nil, fmt.Errorf("%w: negative scrape timeout", ErrInvalidConfig)
	}
	if cfg.Partitions < 0 {
		return nil, fmt.Errorf("%w: negative partition count", ErrInvalidConfig)
	}
	m := &Metrics{
		cfg: cfg,
		src: src,
		reg: prometheus.NewRegistry(),
		log: cfg.Logger,
		changes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmapper_ownership_changes_total",
			Help: "Partitions this replica acquired or gave up (released, lost or expired).",
		}, []string{"change"}),
		gap: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvmapper_unowned_gap_seconds",
			Help:    "How long a partition this replica acquired had been without an owner, as this replica saw it.",
			Buckets: cfg.GapBuckets,
		}),
		tableUpdates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmapper_table_updates_total",
			Help: "Live changes of the groups bucket applied to the in-memory table (the initial load is not counted).",
		}, []string{"op"}),
		fenced: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmapper_fenced_total",
			Help: "Partitions this replica stopped because it lost their lease or a newer owner fenced them, instead of handing them over (alert on any).",
		}),
		fenceFails: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmapper_fence_write_failures_total",
			Help: "Partitions this replica released because it could not write their fence record in an output stream (a full stream, one that does not capture its fence subjects, a refusal): the partition does not map until a replica can (alert on any).",
		}),
	}
	for _, c := range []string{ChangeAcquired, ChangeReleased} {
		m.changes.WithLabelValues(c)
	}
	for _, op := range []string{"put", "delete"} {
		m.tableUpdates.WithLabelValues(op)
	}
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "kvmapper_build_info",
		Help:        "Always 1; the labels name this replica and its version.",
		ConstLabels: prometheus.Labels{"replica": cfg.Replica, "version": cfg.Version},
	})
	build.Set(1)
	ready := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvmapper_ready",
		Help: "1 while /readyz answers 200 (connected, groups table loaded, not stopping), else 0.",
	}, func() float64 {
		if cfg.Ready != nil && cfg.Ready() != nil {
			return 0
		}
		return 1
	})
	cs := []prometheus.Collector{
		m.changes, m.gap, m.tableUpdates, m.fenced, m.fenceFails, build, ready,
		&collector{m: m},
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	}
	if cfg.Partitions > 0 {
		configured := prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmapper_partitions_configured",
			Help: "Partitions the deployment has: every one should have a lease (alert when the sum of kvmapper_partitions_owned is below it).",
		})
		configured.Set(float64(cfg.Partitions))
		cs = append(cs, configured)
	}
	for _, c := range cs {
		if err := m.reg.Register(c); err != nil {
			return nil, fmt.Errorf("metrics: registering collector: %w", err)
		}
	}
	return m, nil
}

// Kinds of ownership change for [Metrics.ObserveOwnership].
const (
	ChangeAcquired = "acquired" // this replica claimed a partition
	ChangeReleased = "released" // this replica's lease ended: handed over, lost or expired
)

// ObserveOwnership records an ownership change of this replica: change is [ChangeAcquired] or
// [ChangeReleased]; unowned is how long an acquired partition had been without an owner.
func (m *Metrics) ObserveOwnership(change string, unowned time.Duration) {
	m.changes.WithLabelValues(change).Inc()
	if change == ChangeAcquired {
		m.gap.Observe(unowned.Seconds())
	}
}

// ObserveFenced records that this replica stopped a partition because it lost the lease or a
// newer owner fenced it: the partition was not handed over.
func (m *Metrics) ObserveFenced() { m.fenced.Inc() }

// ObserveFenceWriteFailure records that this replica released a partition because it could not
// write the partition's fence record in one of its output streams.
func (m *Metrics) ObserveFenceWriteFailure() { m.fenceFails.Inc() }

// ObserveTableUpdate records one live change of the groups table: a put, or a delete when
// deleted is true. It is cheap enough for the table's watch goroutine.
func (m *Metrics) ObserveTableUpdate(deleted bool) {
	op := "put"
	if deleted {
		op = "delete"
	}
	m.tableUpdates.WithLabelValues(op).Inc()
}

// Registry returns the registry the metrics are in, for tests and for embedding.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// collector turns a Snapshot into metrics at scrape time.
type collector struct{ m *Metrics }

var (
	descMapped     = prometheus.NewDesc("kvmapper_mapped_total", "Messages republished to OUTGOING (acknowledged as new).", nil, nil)
	descUnmapped   = prometheus.NewDesc("kvmapper_unmapped_total", "Messages sent to UNMAPPED, by reason.", []string{"reason"}, nil)
	descDuplicates = prometheus.NewDesc("kvmapper_duplicates_total", "Publishes OUTGOING or UNMAPPED acknowledged as duplicates (retries and takeovers).", nil, nil)
	descRetries    = prometheus.NewDesc("kvmapper_publish_retries_total", "Messages republished after a publish failure.", nil, nil)
	descFailures   = prometheus.NewDesc("kvmapper_publish_failures_total", "Publish failures (each is retried or dead-lettered).", nil, nil)
	descDropped    = prometheus.NewDesc("kvmapper_dropped_total", "Dead letters UNMAPPED refused even stripped: left in INCOMING and logged.", nil, nil)
	descReorders   = prometheus.NewDesc("kvmapper_reorders_total", "Messages this replica stored after a later message of the same device (order reversed; alert on any).", nil, nil)
	descInFlight   = prometheus.NewDesc("kvmapper_in_flight", "Publishes awaiting acknowledgement.", nil, nil)
	descOwned      = prometheus.NewDesc("kvmapper_partitions_owned", "Partitions this replica holds a lease for.", nil, nil)
	descLag        = prometheus.NewDesc("kvmapper_partition_lag_messages", "Messages of the partition in INCOMING not yet acknowledged downstream (running lanes only).", []string{"partition"}, nil)
	descWait       = prometheus.NewDesc("kvmapper_partition_wait_seconds", "How long the partition's lane has been waiting for a publish's answer, its consumer, room in the in-flight window or a checkpoint write, once past a few seconds (kvmapper status says what for); 0 while it is not waiting.", []string{"partition"}, nil)
	descCheckpoint = prometheus.NewDesc("kvmapper_partition_checkpoint_sequence", "INCOMING sequence last written to checkpoint.<p>.", []string{"partition"}, nil)
	descAcked      = prometheus.NewDesc("kvmapper_partition_acked_sequence", "Last INCOMING sequence of the partition's contiguous acknowledged prefix.", []string{"partition"}, nil)
	descEpoch      = prometheus.NewDesc("kvmapper_partition_epoch", "Lease revision at claim (fencing token) of the partition's running lane.", []string{"partition"}, nil)
	descDevices    = prometheus.NewDesc("kvmapper_table_devices", "Devices in the in-memory groups table.", nil, nil)
	descRevision   = prometheus.NewDesc("kvmapper_table_revision", "Groups bucket revision applied to the table.", nil, nil)
	descWatchLag   = prometheus.NewDesc("kvmapper_table_watch_lag_revisions", "Revisions the groups bucket holds beyond what the table has applied.", nil, nil)
	descEventsPub  = prometheus.NewDesc("kvmapper_events_published_total", "Ownership events published.", nil, nil)
	descEventsDrop = prometheus.NewDesc("kvmapper_events_dropped_total", "Ownership events dropped because the publisher fell behind.", nil, nil)
	descParked     = prometheus.NewDesc("kvmapper_parked_total", "Messages of devices without a mapping parked in PARKED (--on-unmapped park).", nil, nil)
	descReleased   = prometheus.NewDesc("kvmapper_released_total", "Parked messages republished to OUTGOING once their device had a group (also counted in kvmapper_mapped_total).", nil, nil)
	descParkedDevs = prometheus.NewDesc("kvmapper_parked_devices", "Devices this replica's lanes hold parked.", nil, nil)
	descParkedMsgs = prometheus.NewDesc("kvmapper_parked_messages", "Messages this replica's lanes hold parked, as far as they know (PARKED is the record).", nil, nil)
	descLeaseTTL   = prometheus.NewDesc("kvmapper_lease_ttl_seconds", "Partition lease TTL: a replica killed outright has its partitions taken over after about this.", nil, nil)
	descReplicas   = prometheus.NewDesc("kvmapper_stream_replicas", "Replicas a stream or bucket was created with (0: its info could not be read).", []string{"stream"}, nil)
	descHasLeader  = prometheus.NewDesc("kvmapper_stream_has_leader", "1 when the stream or bucket has a leader, 0 while it elects one or does not answer.", []string{"stream"}, nil)
	descLeader     = prometheus.NewDesc("kvmapper_stream_leader", "1 for the server that leads the stream or bucket.", []string{"stream", "server"}, nil)
	descFollowLag  = prometheus.NewDesc("kvmapper_stream_follower_lag", "Operations a follower of the stream or bucket is behind its leader.", []string{"stream", "server"}, nil)
	descFollowCur  = prometheus.NewDesc("kvmapper_stream_follower_current", "1 when a follower of the stream or bucket has everything its leader has.", []string{"stream", "server"}, nil)
	descWriteMode  = prometheus.NewDesc("kvmapper_write_mode", "1 for how the replica writes an output stream: atomic or fast-ingest batches (a leader change reorders nothing), or single publishes.", []string{"stream", "mode"}, nil)
	descWatchRest  = prometheus.NewDesc("kvmapper_control_watch_restarts_total", "Control bucket watches replaced because they stopped showing this replica's own lease writes (the watch's consumer cut off from the bucket's leader): leases are judged from a new watch.", nil, nil)
	descFollowSeen = prometheus.NewDesc("kvmapper_stream_follower_seen_seconds", "Since the leader of the stream or bucket last heard from a follower.", []string{"stream", "server"}, nil)
	collectorDescs = []*prometheus.Desc{descMapped, descUnmapped, descDuplicates, descRetries, descFailures, descDropped, descReorders, descInFlight, descOwned, descLag, descWait, descCheckpoint, descAcked, descEpoch, descDevices, descRevision, descWatchLag, descEventsPub, descEventsDrop,
		descParked, descReleased, descParkedDevs, descParkedMsgs,
		descLeaseTTL, descReplicas, descHasLeader, descLeader, descFollowLag, descFollowCur, descFollowSeen, descWriteMode, descWatchRest}
)

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range collectorDescs {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.m.cfg.ScrapeTimeout)
	s := c.m.src(ctx)
	cancel()
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter(descMapped, s.Mapped)
	counter(descDuplicates, s.Duplicates)
	counter(descRetries, s.Retries)
	counter(descFailures, s.Failures)
	counter(descDropped, s.Dropped)
	counter(descReorders, s.Reorders)
	for _, r := range c.m.cfg.UnmappedReasons {
		if _, ok := s.Unmapped[r]; !ok {
			counter(descUnmapped, 0, r)
		}
	}
	for r, n := range s.Unmapped {
		counter(descUnmapped, n, r)
	}
	gauge(descInFlight, float64(s.InFlight))
	gauge(descOwned, float64(s.Owned))
	for _, p := range s.Partitions {
		l := strconv.Itoa(p.Partition)
		gauge(descLag, float64(p.Lag), l)
		gauge(descWait, p.Waiting.Seconds(), l)
		gauge(descCheckpoint, float64(p.Checkpoint), l)
		gauge(descAcked, float64(p.Acked), l)
		gauge(descEpoch, float64(p.Epoch), l)
	}
	gauge(descDevices, float64(s.TableDevices))
	gauge(descRevision, float64(s.TableRevision))
	if s.WatchLag >= 0 {
		gauge(descWatchLag, float64(s.WatchLag))
	}
	counter(descEventsPub, s.EventsPublished)
	counter(descEventsDrop, s.EventsDropped)
	counter(descWatchRest, s.WatchRestarts)
	counter(descParked, s.Parked)
	counter(descReleased, s.Released)
	gauge(descParkedDevs, float64(s.ParkedDevices))
	gauge(descParkedMsgs, float64(s.ParkedMessages))
	if s.LeaseTTL > 0 {
		gauge(descLeaseTTL, s.LeaseTTL.Seconds())
	}
	for stream, mode := range s.WriteModes {
		gauge(descWriteMode, 1, stream, mode)
	}
	for _, st := range s.Streams {
		gauge(descReplicas, float64(st.Replicas), st.Name)
		has := 0.0
		if st.Leader != "" {
			has = 1
			gauge(descLeader, 1, st.Name, st.Leader)
		}
		gauge(descHasLeader, has, st.Name)
		for _, f := range st.Followers {
			cur := 0.0
			if f.Current {
				cur = 1
			}
			gauge(descFollowLag, float64(f.Lag), st.Name, f.Server)
			gauge(descFollowCur, cur, st.Name, f.Server)
			gauge(descFollowSeen, f.SeenAgo.Seconds(), st.Name, f.Server)
		}
	}
}
