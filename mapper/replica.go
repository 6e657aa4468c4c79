package mapper

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/metrics"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/wire"

	"github.com/kvmapper/kvmapper/subjects"
)

// ErrInvalidConfig is wrapped by the errors of [New] for a configuration the replica cannot run
// with (a flag out of range, say), so that a command can tell a usage error from a failure.
var ErrInvalidConfig = errors.New("mapper: invalid config")

// Config is everything one replica needs besides its connection. Zero fields mean the defaults
// of each component.
type Config struct {
	// ID names the replica: its member key, its leases and its status subject. Required.
	ID    string
	Setup setup.Config
	// Table tunes the groups table; its Logger is set from Logger and OnUpdate is chained
	// after the replica's own.
	Table kv.Config
	// Lanes tunes the lanes: Layout is required; Incoming, StreamLayout and Logger are set from
	// Setup and Logger. With Lanes.Park.New (--on-unmapped park) setup creates PARKED (with
	// Setup.Park's limits, or the defaults) and the lanes park devices without a mapping; without
	// it, a PARKED that exists is still drained (see [New]). Park's Stream and Prefix are set
	// from Setup's names.
	Lanes lanes.Config
	// Election tunes the elector; ReplicaID, Partitions and Logger are set from the rest, and
	// OnChange is chained. A zero LeaseTTL is chosen from the control bucket's replica count
	// (election.LeaseTTLFor) and logged; a zero RenewInterval is [DefaultRenewInterval].
	Election election.Config
	Logger   zerolog.Logger
	// Version is reported by the status service and in metrics.
	Version string
	// Direct tunes direct mode (Setup.Mode is wire.ModeDirect), which runs in place of the lanes;
	// its Layout is the lanes' and its Receive, Replica, HandoffPrefix, Revision, CatchUp, Alone
	// and Logger are set from the rest.
	Direct direct.Config

	// MetricsListen is the host:port of the /metrics, /healthz and /readyz server; "" means none.
	// Port 0 picks a free port; the address is logged ("metrics listening").
	MetricsListen string
	// EventsSubject is where this replica publishes its ownership changes; "" means nowhere.
	EventsSubject string
	// Control, when set, is a JetStream context on a connection of the replica's own for the
	// control plane: leases, member heartbeats, checkpoints, the groups table. The lanes' reads
	// and writes stay on the connection [New] is given. `kvmapper run` dials one; nil shares the
	// lanes' connection.
	Control jetstream.JetStream
	// Host names the machine in status reports; default os.Hostname.
	Host string
}

// Replica wires the components of one kvmapper replica: the groups table (kv), the lanes and the
// elector that hands partitions to the lanes. Its methods are safe for concurrent use.
type Replica struct {
	id      string
	log     zerolog.Logger
	nc      *nats.Conn
	js      jetstream.JetStream
	streams []string // every stream and bucket stream the replica uses, for metrics
	groups  jetstream.KeyValue
	control jetstream.KeyValue
	table   *kv.Table
	pool    engine              // the lanes, or in direct mode the direct pool
	direct  *direct.Pool        // direct mode only
	release func(device string) // the lanes' Pool.Release; nil in direct mode
	elector *election.Elector

	// Observation: metrics always (cheap; served only with MetricsListen), the micro status
	// service always, events when EventsSubject is set.
	metrics       *metrics.Metrics
	service       *status.Service
	events        *status.Events // nil when disabled
	metricsListen string
	version       string
	partitions    int // the layout's, for the metrics
	leaseTTL      time.Duration
	stopTimeout   time.Duration
	stopping      atomic.Bool // set when Run's context ends, for /readyz
}

// leaseTTL returns the lease TTL to run with: ttl when set, else the one for the control
// bucket's replica count. It logs which, and warns of a TTL a replicated bucket's election
// outlasts.
func leaseTTL(ctx context.Context, control jetstream.KeyValue, ttl time.Duration, log zerolog.Logger) (time.Duration, int, error) {
	st, err := control.Status(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("reading bucket %s: %w", control.Bucket(), err)
	}
	replicas := 1
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok {
		replicas = bs.StreamInfo().Config.Replicas
	}
	switch {
	case ttl == 0:
		ttl = election.LeaseTTLFor(replicas)
		log.Info().Int64("lease_ttl_ms", ttl.Milliseconds()).Int("control_replicas", replicas).
			Msg("lease TTL chosen for the control bucket's replicas (--lease-ttl sets it): a replica killed outright has its partitions taken over after about this")
	case replicas > 1 && ttl < election.ReplicatedLeaseTTL:
		log.Warn().Int64("lease_ttl_ms", ttl.Milliseconds()).Int("control_replicas", replicas).Int64("recommended_ms", election.ReplicatedLeaseTTL.Milliseconds()).
			Msg("lease TTL below the election time of a replicated control bucket: the death of the NATS server leading it expires every lease, and every partition stops and moves")
	default:
		log.Info().Int64("lease_ttl_ms", ttl.Milliseconds()).Int("control_replicas", replicas).Msg("lease TTL as configured")
	}
	return ttl, replicas, nil
}

// DirectReleaseTimeout is how long a direct-mode replica waits for a released partition's Run to
// return (election.Config.ReleaseTimeout) unless configured otherwise.
const DirectReleaseTimeout = 30 * time.Second

// DefaultJudgedExpiry is how long of writable time an owner may stay silent on a replicated
// control bucket before the others take its partitions over, when its lanes vouch, on its
// leases, that they write every output stream fence-checked (election.Config.JudgedExpiry,
// lanes.Pool.Checked).
const DefaultJudgedExpiry = 2 * time.Second

// DefaultRenewInterval is how often leases are renewed unless configured otherwise (kvmapper
// run's --renew-interval). It is the mapper's, not the elector's LeaseTTL/4: on a replicated
// control bucket (15 s TTL) that would be 3.75 s, too slow for [DefaultJudgedExpiry], which must
// be at least two renewals, and a replica built on this package with a zero Election would fail
// to start on a cluster.
const DefaultRenewInterval = 500 * time.Millisecond

// judgedExpiry returns the judged expiry to run with: the configured one, or
// [DefaultJudgedExpiry] where it is worth it — a replicated control bucket, whose 15 s lease TTL
// a takeover would otherwise wait for — else 0 (off). It is safe whatever the other replicas
// run: an owner is judged only when its last renewal vouches that the output streams refuse what
// it writes after a takeover (election.Config.Judge, lanes.Pool.CanJudge), which an older build,
// a replica whose streams are not all fenced, or one writing unchecked never does; the others
// keep their lease TTL. A judged expiry asked for where this replica cannot fence (direct mode,
// lanes.Config.Unfenced) is refused.
func judgedExpiry(ctx context.Context, controlReplicas int, ecfg election.Config, pool engine, log zerolog.Logger) (time.Duration, error) {
	lp, ok := pool.(*lanes.Pool)
	canFence := ok && !lp.Unfenced()
	if ecfg.JudgedExpiry != 0 {
		if !canFence {
			return 0, fmt.Errorf("%w: a judged expiry needs output streams that refuse a deposed owner: stream mode, and lanes that write fence records", ErrInvalidConfig)
		}
		return ecfg.JudgedExpiry, nil
	}
	if controlReplicas < 2 || !canFence {
		return 0, nil
	}
	ev := log.Info().Dur("judged_expiry", DefaultJudgedExpiry)
	if lp.CanFence(ctx) {
		ev.Msg("output streams fenced: a replica silent for this long while the control bucket takes writes has its partitions taken over, if its leases say it writes them fence-checked")
	} else {
		ev.Msg("judged expiry on for replicas whose leases say they write every output stream fence-checked; this one's streams are not all fenced now (kvmapper setup records them), so its own partitions wait for their lease TTL")
	}
	return DefaultJudgedExpiry, nil
}

// New runs setup (creating or verifying the streams and buckets), opens the buckets and builds
// the components; it blocks for up to 30 s on setup. Errors from a configuration the components
// refuse wrap [ErrInvalidConfig], as does a Setup.StreamLayout of subjects.AutoLayout: resolve
// it with setup.ChooseLayout before.
func New(ctx context.Context, js jetstream.JetStream, cfg Config) (*Replica, error) {
	if cfg.ID == "" {
		return nil, fmt.Errorf("%w: ID is required", ErrInvalidConfig)
	}
	log := cfg.Logger
	if cfg.Lanes.Park.New && cfg.Setup.Mode == wire.ModeDirect {
		return nil, fmt.Errorf("%w: parking needs stream mode: in direct mode no stream holds a device's messages", ErrInvalidConfig)
	}
	if cfg.Setup.StreamLayout == subjects.AutoLayout {
		// The lanes, status and metrics need the layout itself, and the command logs it.
		return nil, fmt.Errorf("%w: Setup.StreamLayout is auto: resolve it with setup.ChooseLayout first", ErrInvalidConfig)
	}
	if cfg.Lanes.Park.New && cfg.Setup.Park == nil {
		cfg.Setup.Park = &setup.ParkedStream{}
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	lines, err := setup.Ensure(sctx, js, cfg.Setup)
	cancel()
	for _, l := range lines {
		log.Debug().Msg(l)
	}
	if err != nil {
		return nil, err
	}
	// The control plane (leases, member heartbeats, checkpoints, the groups table) goes on a
	// connection of its own when given one: on the lanes' connection it queues behind their
	// deliveries and batches, in both directions, and a renewal late by the lease's margin
	// loses the lease.
	cjs := js
	if cfg.Control != nil {
		cjs = cfg.Control
	}
	groups, err := cjs.KeyValue(ctx, cfg.Setup.Groups)
	if err != nil {
		return nil, fmt.Errorf("opening bucket %s: %w", cfg.Setup.Groups, err)
	}
	control, err := cjs.KeyValue(ctx, cfg.Setup.Control)
	if err != nil {
		return nil, fmt.Errorf("opening bucket %s: %w", cfg.Setup.Control, err)
	}
	r := &Replica{id: cfg.ID, log: log, nc: js.Conn(), js: js, groups: groups, control: control,
		metricsListen: cfg.MetricsListen, version: cfg.Version}
	tcfg := cfg.Table
	tcfg.Logger = log.With().Str("component", "kv").Logger()
	if tcfg.Schema == nil && cfg.Lanes.Layout != nil {
		tcfg.Schema = cfg.Lanes.Layout.Schema() // the table decodes values once, for these templates
	}
	next := tcfg.OnUpdate
	tcfg.OnUpdate = func(u kv.Update) {
		if !u.Initial {
			r.metrics.ObserveTableUpdate(u.Deleted)
		}
		if !u.Deleted && !u.Entry.Invalid && r.release != nil {
			r.release(u.Device) // a parked device got a group
		}
		if next != nil {
			next(u)
		}
	}
	table, err := kv.New(groups, tcfg)
	if err != nil {
		return nil, err
	}
	// Every stream and bucket the replica uses, for the replication metrics: in direct mode
	// there is no INCOMING.
	names := cfg.Setup.Names.WithDefaults()
	r.streams = status.StreamNames(names, cfg.Lanes.Layout.Partitions)
	r.partitions = cfg.Lanes.Layout.Partitions
	if cfg.Setup.Mode == wire.ModeDirect {
		r.streams = r.streams[len(names.IncomingStreams(cfg.Lanes.Layout.Partitions)):]
	}
	lookup := table.Mapping
	var pool engine
	fenced := lanes.ErrFenced
	catchUp := table.CatchUp
	if cfg.Setup.Mode == wire.ModeDirect {
		if r.direct, err = newDirect(js.Conn(), lookup, table, control, cfg); err != nil {
			return nil, invalid(err, direct.ErrInvalidConfig)
		}
		pool, fenced = directEngine{r.direct}, direct.ErrFenced
		catchUp = func(context.Context) error { return nil }
		if cfg.Election.ReleaseTimeout == 0 {
			// A released partition's Run returns at once, or once a takeover it was in the middle
			// of ends (HandoffTimeout); the wait is the election's default, stated here so that
			// StopTimeout can count it.
			cfg.Election.ReleaseTimeout = DirectReleaseTimeout
		}
	} else {
		lcfg := cfg.Lanes
		lcfg.Logger = log.With().Str("component", "lanes").Logger()
		// The lanes read the streams setup made: one place says what they are.
		lcfg.Incoming, lcfg.StreamLayout = names.Incoming, names.StreamLayout
		lcfg.Outgoing, lcfg.Unmapped = names.Outgoing, names.Unmapped
		// The output streams setup fenced: each lane writes its record there on takeover. They
		// are read again while the replica runs: setup may record or drop them meanwhile.
		if lcfg.Fences, err = setup.ReadFences(ctx, control); err != nil {
			return nil, err
		}
		lcfg.RefreshFences = func(ctx context.Context) ([]string, error) { return setup.ReadFences(ctx, control) }
		if err := parking(ctx, js, control, &lcfg.Park, names, log); err != nil {
			return nil, err
		}
		lp, err := lanes.New(js, control, lookup, lcfg)
		if err != nil {
			return nil, invalid(err, lanes.ErrInvalidConfig)
		}
		pool, r.release = lp, lp.Release
		if cfg.Election.ReleaseTimeout == 0 {
			// A releasing lane may wait DrainTimeout for acknowledgements, then write a checkpoint.
			cfg.Election.ReleaseTimeout = lp.DrainTimeout() + 10*time.Second
		}
	}
	ecfg := cfg.Election
	ecfg.RenewInterval = cmp.Or(ecfg.RenewInterval, DefaultRenewInterval)
	var controlReplicas int
	if ecfg.LeaseTTL, controlReplicas, err = leaseTTL(ctx, control, ecfg.LeaseTTL, log); err != nil {
		return nil, err
	}
	if ecfg.JudgedExpiry, err = judgedExpiry(ctx, controlReplicas, ecfg, pool, log); err != nil {
		return nil, err
	}
	r.leaseTTL = ecfg.LeaseTTL
	if lp, ok := pool.(*lanes.Pool); ok {
		// Leases say what their lanes vouch for; only owners whose leases say they write
		// fence-checked are judged dead early, and their successor fences what they named.
		ecfg.Checked, ecfg.Judge = lp.Checked, lp.CanJudge
	}
	r.stopTimeout = ecfg.ReleaseTimeout
	if r.direct != nil {
		r.stopTimeout += r.direct.CloseTimeout()
	}
	log.Debug().Int64("stop_timeout_ms", r.stopTimeout.Milliseconds()).
		Msg("a stop hands the partitions over within stop_timeout_ms (a supervisor's grace period must cover it)")
	ecfg.ReplicaID = cfg.ID
	ecfg.Partitions = cfg.Lanes.Layout.Partitions
	ecfg.Logger = log.With().Str("component", "election").Logger()
	if next := ecfg.OnChange; next != nil {
		ecfg.OnChange = func(c election.Change) { r.observeChange(c); next(c) }
	} else {
		ecfg.OnChange = r.observeChange
	}
	elector, err := election.New(cjs, control, func(ctx context.Context, l *election.Lease) (err error) {
		defer func() {
			if errors.Is(err, fenced) || errors.Is(context.Cause(ctx), election.ErrLeaseLost) {
				r.metrics.ObserveFenced()
			}
			if errors.Is(err, lanes.ErrFenceWrite) {
				// Returned, the election logs it and releases the lease (the lane wrote nothing).
				r.metrics.ObserveFenceWriteFailure()
			}
		}()
		// The previous owner may have mapped with group values this replica's table has not
		// applied yet; mapping before they land would send the partition's next messages back
		// to the old group (I4). The lease stays held while the table catches up. In direct
		// mode the pool catches up itself, once it has subscribed and announced itself: waiting
		// here, before it subscribes, would leave the previous owner nobody to hand over to, and
		// the devices' messages meanwhile no PubAck.
		if err := catchUp(ctx); err != nil {
			if ctx.Err() != nil {
				log.Info().Err(err).Int("partition", l.Partition).
					Msg("partition ended before the groups table caught up")
				return nil
			}
			return err
		}
		// The lanes know nothing of the election: a lost lease reaches them as lanes.ErrFenced
		// (direct.ErrFenced), which stops a lane without resending (handing over); a release
		// lets it drain (hand over).
		lctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
		defer cancel(nil)
		stop := context.AfterFunc(ctx, func() {
			if cause := context.Cause(ctx); errors.Is(cause, election.ErrLeaseLost) {
				cancel(fmt.Errorf("%w: %w", fenced, cause))
			} else {
				cancel(cause)
			}
		})
		defer stop()
		a := lanes.Assignment{Partition: l.Partition, Epoch: l.Epoch, Valid: l.Valid, Owner: cfg.ID}
		if l.Checked != "" {
			a.Fence, _ = wire.ParseChecked(l.Checked) // what the owner judged dead vouched for
		}
		err = pool.Run(lctx, a)
		if errors.Is(err, fenced) && ctx.Err() == nil {
			// Fenced by its output (a newer owner's record): the lease is that owner's now.
			return fmt.Errorf("%w: %w", election.ErrLeaseLost, err)
		}
		return err
	}, ecfg)
	if err != nil {
		return nil, invalid(err, election.ErrInvalidConfig)
	}
	r.table, r.pool, r.elector = table, pool, elector
	if err := r.newObservers(cfg); err != nil {
		return nil, err
	}
	return r, nil
}

// Run loads the groups table, calls ready once it is loaded, then takes part in the election
// until ctx is done, when it hands its partitions over. It returns when every component has
// stopped; nil after a clean stop.
//
// The observers (status service, ownership events, metrics server) start first and stop last,
// so that a replica can be watched while it drains and hands its partitions over; /readyz turns
// 503 as soon as ctx is done. An observer that fails stops the replica with its error.
func (r *Replica) Run(ctx context.Context, ready func()) error {
	parent := ctx
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	stopObservers, err := r.startObservers(ctx, fail)
	if err != nil {
		return err
	}
	defer stopObservers()

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return r.table.Run(gctx) })
	g.Go(func() error {
		select {
		case <-r.table.Ready():
		case <-gctx.Done():
			return nil
		}
		if ready != nil {
			ready()
		}
		return r.elector.Run(gctx)
	})
	err = g.Wait()
	if r.direct != nil {
		r.direct.Close() // the partitions still handing over to their next owners
	}
	if parent.Err() == nil && ctx.Err() != nil {
		return context.Cause(ctx) // an observer failed
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// parking sets the lanes' parking from the names setup used: on for new devices with
// --on-unmapped park; otherwise on only to drain a PARKED that the deployment used (setup wrote
// the control bucket's parked key; parked by an earlier run, or by another replica), so that
// turning parking off neither strands parked messages nor lets a parked device's live messages
// overtake them. A deployment that never parked never touches PARKED.
func parking(ctx context.Context, js jetstream.JetStream, control jetstream.KeyValue, pc *lanes.ParkConfig, names subjects.Names, log zerolog.Logger) error {
	pc.Prefix, pc.Stream = names.ParkedPrefix, ""
	if pc.New {
		pc.Stream = names.Parked
		return nil
	}
	_, err := control.Get(ctx, wire.ParkedKey)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return nil
	case err != nil:
		return fmt.Errorf("reading %s in bucket %s: %w", wire.ParkedKey, control.Bucket(), err)
	}
	s, err := js.Stream(ctx, names.Parked)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil
	case err != nil:
		return fmt.Errorf("opening stream %s (this deployment has parked devices: %s is set in bucket %s): %w", names.Parked, wire.ParkedKey, control.Bucket(), err)
	}
	pc.Stream = names.Parked
	if n := s.CachedInfo().State.Msgs; n > 0 {
		log.Warn().Str("stream", names.Parked).Uint64("messages", n).
			Msg("PARKED holds parked messages: they are released as their devices get a group (or expire, or are unparked), but no new device is parked (--on-unmapped dead-letter)")
	}
	return nil
}

// invalid wraps err in [ErrInvalidConfig] when it wraps a component's sentinel: a configuration
// the component refused.
func invalid(err, sentinel error) error {
	if errors.Is(err, sentinel) {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return err
}

// newObservers builds the metrics, the status service and the ownership events publisher.
func (r *Replica) newObservers(cfg Config) error {
	host := cfg.Host
	if host == "" {
		host, _ = os.Hostname()
	}
	var err error
	r.metrics, err = metrics.New(r.metricsSnapshot, metrics.Config{
		Replica:         r.id,
		Version:         r.version,
		Partitions:      r.partitions,
		UnmappedReasons: wire.Reasons,
		Ready:           r.readyErr,
		Logger:          r.log.With().Str("component", "metrics").Logger(),
	})
	if err != nil {
		return err
	}
	r.service, err = status.NewService(r.nc, r.report, status.ServiceConfig{
		Replica: r.id,
		Control: r.control.Bucket(),
		Host:    host,
		Version: r.version,
		Logger:  r.log.With().Str("component", "status").Logger(),
	})
	if err != nil {
		return err
	}
	if cfg.EventsSubject == "" {
		return nil
	}
	resume := func(ctx context.Context, p int) (uint64, error) {
		e, err := r.control.Get(ctx, wire.CheckpointKey(p))
		if err != nil {
			return 0, err
		}
		cp, err := wire.ParseCheckpoint(e.Value())
		return cp.Seq, err
	}
	if r.direct != nil {
		resume = nil // direct mode keeps no checkpoints
	}
	r.events, err = status.NewEvents(r.nc, status.EventsConfig{
		Subject:   cfg.EventsSubject,
		Replica:   r.id,
		ResumeSeq: resume,
		Logger:    r.log.With().Str("component", "events").Logger(),
	})
	return err
}

// startObservers listens for metrics (so that a taken port fails the start) and starts the
// observers under a context of their own. The returned func stops them and waits for them;
// an observer that fails before that calls fail with its error.
func (r *Replica) startObservers(ctx context.Context, fail context.CancelCauseFunc) (stop func(), err error) {
	var ln net.Listener
	if r.metricsListen != "" {
		ln, err = net.Listen("tcp", r.metricsListen)
		if err != nil {
			return nil, fmt.Errorf("metrics: listening on %s: %w (is the port taken? see --metrics-listen)", r.metricsListen, err)
		}
		r.log.Info().Str("addr", ln.Addr().String()).Msg("metrics listening on http://" + ln.Addr().String() + "/metrics")
	}
	stopReady := context.AfterFunc(ctx, func() { r.stopping.Store(true) })
	octx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var g errgroup.Group
	run := func(f func(context.Context) error) {
		g.Go(func() error {
			err := f(octx)
			if err != nil && octx.Err() == nil {
				fail(err)
			}
			return err
		})
	}
	if ln != nil {
		run(func(ctx context.Context) error { return r.metrics.Serve(ctx, ln) })
	}
	run(r.service.Run)
	if r.events != nil {
		run(r.events.Run)
	}
	return func() {
		stopReady()
		cancel()
		_ = g.Wait() // a failure has been handed to fail already
	}, nil
}

// observeChange is election's OnChange: it runs on the election's watch goroutine and must not
// block. Only changes about this replica count, so that N replicas do not report each change N
// times: its claims (with the gap before them) and the end of its leases.
func (r *Replica) observeChange(c election.Change) {
	switch {
	case c.NewOwner == r.id:
		r.metrics.ObserveOwnership(metrics.ChangeAcquired, c.Unowned)
	case c.OldOwner == r.id:
		r.metrics.ObserveOwnership(metrics.ChangeReleased, 0)
		if c.NewOwner != "" {
			return // taken straight over: the new owner publishes the event
		}
	default:
		return
	}
	if r.events != nil {
		r.events.Offer(status.Event{
			Partition:    c.Partition,
			OldOwner:     c.OldOwner,
			NewOwner:     c.NewOwner,
			Epoch:        c.Epoch,
			UnownedGapMS: c.Unowned.Milliseconds(),
			At:           c.At.UTC(),
		})
	}
}

// readyErr says why the replica is not ready, or nil: it must be connected to NATS, have loaded
// the groups table and not be stopping.
func (r *Replica) readyErr() error {
	switch {
	case r.stopping.Load():
		return errors.New("stopping: handing partitions over")
	case !r.nc.IsConnected():
		return fmt.Errorf("not connected to NATS (%s)", r.nc.Status())
	}
	select {
	case <-r.table.Ready():
		return nil
	default:
		return errors.New("groups table not loaded yet")
	}
}

// report is the answer of the status endpoint.
func (r *Replica) report() status.Report {
	st := r.pool.Stats()
	parts := r.pool.Partitions()
	rep := status.Report{
		Ready:      r.readyErr() == nil,
		Owned:      r.elector.Owned(),
		Partitions: make([]status.PartitionReport, 0, len(parts)),
		Counters: status.Counters{
			Mapped: st.Mapped, Unmapped: st.Unmapped, Duplicates: st.Duplicates,
			Retries: st.Retries, Failures: st.Failures, InFlight: st.InFlight,
			Parked: st.Parked, Released: st.Released, ParkedDevices: st.ParkedDevices, ParkedMessages: st.ParkedMessages,
		},
		Table: status.Table{Devices: r.table.Len(), Revision: r.table.Revision(), Invalid: r.table.Invalid()},
	}
	for _, p := range parts {
		rep.Partitions = append(rep.Partitions, status.PartitionReport{
			Partition: p.Partition, Epoch: p.Epoch, Acked: p.Acked, Checkpoint: p.Checkpoint,
			Pending: p.Pending, InFlight: p.InFlight, Lag: p.Lag(),
			ParkedDevices: p.ParkedDevices, ParkedMessages: p.ParkedMessages,
		})
		if w := p.Waiting; w != nil {
			rep.Partitions[len(rep.Partitions)-1].Waiting = &status.Waiting{For: w.For, Stream: w.Stream, Server: w.Server, Since: w.Since}
		}
	}
	return rep
}

// streamInfoTimeout bounds each stream info request of a scrape: a replicated stream electing a
// leader answers nothing for seconds.
const streamInfoTimeout = time.Second

// metricsSnapshot is the metrics source, read at each scrape. The watch lag costs one request
// to the server (the groups bucket's status), the streams' replication one per stream, all at
// once.
func (r *Replica) metricsSnapshot(ctx context.Context) metrics.Snapshot {
	st := r.pool.Stats()
	s := metrics.Snapshot{
		Mapped: st.Mapped, Unmapped: st.Unmapped, Duplicates: st.Duplicates,
		Retries: st.Retries, Failures: st.Failures, Dropped: st.Dropped, Reorders: st.Reorders, InFlight: st.InFlight,
		Parked: st.Parked, Released: st.Released, ParkedDevices: st.ParkedDevices, ParkedMessages: st.ParkedMessages,
		Owned:         len(r.elector.Owned()),
		TableDevices:  r.table.Len(),
		TableRevision: r.table.Revision(),
		WatchLag:      -1,
		LeaseTTL:      r.leaseTTL,
		WatchRestarts: uint64(r.elector.WatchStalls()),
	}
	if lp, ok := r.pool.(*lanes.Pool); ok {
		s.WriteModes = lp.WriteModes()
	}
	for _, rep := range status.ReadReplication(ctx, r.js, r.streams, streamInfoTimeout) {
		st := metrics.Stream{Name: rep.Stream, Replicas: rep.Replicas, Leader: rep.Leader}
		for _, f := range rep.Followers {
			st.Followers = append(st.Followers, metrics.Follower{Server: f.Name, Current: f.Current, Lag: f.Lag, SeenAgo: f.SeenAgo})
		}
		s.Streams = append(s.Streams, st)
	}
	for _, p := range r.pool.Partitions() {
		s.Partitions = append(s.Partitions, metrics.Partition{
			Partition: p.Partition, Epoch: p.Epoch, Acked: p.Acked, Checkpoint: p.Checkpoint, Lag: p.Lag(),
		})
		if p.Waiting != nil {
			s.Partitions[len(s.Partitions)-1].Waiting = time.Since(p.Waiting.Since)
		}
	}
	if r.events != nil {
		s.EventsPublished, s.EventsDropped = r.events.Published(), r.events.Dropped()
	}
	if bs, err := r.groups.Status(ctx); err == nil {
		if kvs, ok := bs.(*jetstream.KeyValueBucketStatus); ok {
			if last := kvs.StreamInfo().State.LastSeq; last >= s.TableRevision {
				s.WatchLag = int64(last - s.TableRevision)
			} else {
				s.WatchLag = 0
			}
		}
	}
	return s
}

// StopTimeout returns the longest [Replica.Run] takes to hand the partitions over once its context
// ends, before the final lease deletes: the wait for each partition's release
// (Election.ReleaseTimeout: DrainTimeout + 10 s in stream mode, [DirectReleaseTimeout] in direct
// mode), then in direct mode the handoffs still under way (direct.Pool.CloseTimeout). The deploy
// kit's grace periods are derived from it.
func (r *Replica) StopTimeout() time.Duration { return r.stopTimeout }

// LeaseTTL returns the partition lease TTL the replica runs with: as configured, or chosen from
// the control bucket's replica count.
func (r *Replica) LeaseTTL() time.Duration { return r.leaseTTL }

// Stats returns the counters of the replica's lanes.
func (r *Replica) Stats() lanes.Stats { return r.pool.Stats() }

// Devices returns how many devices the groups table holds.
func (r *Replica) Devices() int { return r.table.Len() }

// Owned returns the partitions this replica holds leases for, sorted.
func (r *Replica) Owned() []int { return r.elector.Owned() }

// Serving returns how many partitions this replica maps now: lanes running, or in direct mode
// partitions subscribed and forwarding (a lease alone does not say so).
func (r *Replica) Serving() int { return len(r.pool.Partitions()) }

// WaitServing waits until the replica serves n partitions ([Replica.Serving]), polling, and
// reports whether it does; it gives up with false when ctx ends or timeout passes first.
func (r *Replica) WaitServing(ctx context.Context, n int, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for r.Serving() < n {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
	}
	return true
}

// Lookup returns the device's entry in this replica's groups table, as its lanes see it.
func (r *Replica) Lookup(device string) (kv.Entry, bool) { return r.table.Lookup(device) }

// DefaultID is a replica id for a replica not given one: the host name, with every character an
// id cannot hold replaced by '-', and a random suffix.
func DefaultID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "kvmapper"
	}
	host = strings.Map(func(r rune) rune {
		if r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9') {
			return r
		}
		return '-'
	}, host)
	var b [3]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}
