package replay

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/ratelog"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/ordered"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// Range is the part of one stream a replay reads.
type Range struct {
	Stream string `json:"stream"`
	First  uint64 `json:"first"`
	Last   uint64 `json:"last"` // below First when empty
}

// Summary says what a replay did, or in a dry run would do. Counts are of this run: a resumed
// replay does not count again what an earlier run published.
type Summary struct {
	ID          string  `json:"id"`
	AsOf        uint64  `json:"as_of"` // the groups bucket's revision the replay maps with
	Into        string  `json:"into"`
	DeadLetters string  `json:"dead_letters"` // the stream dead letters go to
	Ranges      []Range `json:"ranges"`
	Read        uint64  `json:"read"`       // messages read from the ranges
	Mapped      uint64  `json:"mapped"`     // stored in Into (in a dry run: would be)
	Duplicates  uint64  `json:"duplicates"` // publishes the target already held (its duplicate window)
	// AlreadyStored counts messages a resumed replay found in its targets and did not send again.
	AlreadyStored uint64 `json:"already_stored"`
	// Skipped counts messages of other devices or partitions than those asked for.
	Skipped uint64            `json:"skipped"`
	Groups  map[string]uint64 `json:"groups"`   // mapped messages per group
	Reasons map[string]uint64 `json:"unmapped"` // dead letters per reason
	// Dropped counts dead letters the dead-letter stream refused even stripped (logged).
	Dropped uint64 `json:"dropped"`
	// Unknown counts the devices whose group at the as-of revision is gone from the bucket's
	// history (dead-lettered with ReasonHistoryMissing).
	Unknown         int           `json:"unknown_devices"`
	Resumed         bool          `json:"resumed"`
	Complete        bool          `json:"complete"`
	AlreadyComplete bool          `json:"already_complete"` // it was complete before this run
	DryRun          bool          `json:"dry_run"`
	Elapsed         time.Duration `json:"-"`
}

// Progress is what [Config.Progress] is told while a replay runs.
type Progress struct {
	ID    string        `json:"id"`
	Done  uint64        `json:"done"`  // sequences of the ranges covered, earlier runs included
	Total uint64        `json:"total"` // sequences in the ranges
	Rate  float64       `json:"rate"`  // sequences per second in this run
	ETA   time.Duration `json:"-"`
	Final bool          `json:"final"` // the last report of the run
	Summary
}

// Replay is one replay of a range of INCOMING. Build it with [New] and call Run once. It is not
// safe for concurrent use.
type Replay struct {
	js  jetstream.JetStream // reads
	cfg Config
	log zerolog.Logger

	parts []bool // partitions read, by partition

	id       string
	st       *store
	rec      record
	snap     *kv.Snapshot
	tg       targets
	prefixes map[string]int // "replay:<id>:<stream>:<incarnation>" → index of its source

	stored  map[string]map[uint64]bool // found in a target on resume, by source stream
	pinned  map[string]uint64          // floors kept while found messages are ahead of Done
	pinTill []uint64                   // by source: the last sequence found on resume
	maxAck  map[string]uint64          // by target: the highest sequence acknowledged
	maxSize map[string]int             // by target: its largest message, when it has a limit
	devices map[string]bool            // nil: all

	q    []*entry       // in flight or settled behind an unsettled one, in stream order
	in   *ordered.Inbox // the writer's answers
	w    *ordered.Writer
	tidx map[string]int // target → index in w's streams

	sum       Summary
	start     time.Time
	doneStart uint64
	fields    subjects.Fields
	buf       []byte
	warns     ratelog.Limiter
}

// New returns a replay reading and publishing with js, as cfg describes. It checks cfg, and
// connects nothing.
func New(js jetstream.JetStream, cfg Config) (*Replay, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: js is required", ErrInvalidConfig)
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	r := &Replay{js: js, cfg: cfg, log: cfg.Logger, parts: cfg.partitions(),
		maxAck: map[string]uint64{}, maxSize: map[string]int{}, warns: ratelog.Limiter{Every: time.Second}}
	if len(cfg.Devices) > 0 {
		r.devices = make(map[string]bool, len(cfg.Devices))
		for _, d := range cfg.Devices {
			r.devices[d] = true
		}
	}
	r.sum = Summary{Groups: map[string]uint64{}, Reasons: map[string]uint64{}, DryRun: cfg.DryRun, Into: cfg.Into}
	return r, nil
}

// Summary returns what the replay did; call it after Run.
func (r *Replay) Summary() Summary { return r.sum }

// ID returns the replay's id, known once Run has read the streams.
func (r *Replay) ID() string { return r.id }

// Run replays the range, or resumes the replay from its progress record, until it is complete or
// ctx is done. It returns nil in both cases (Summary says which), and an error when the replay
// cannot go on: a target it cannot publish to ([ErrTarget]), history that is too short
// ([ErrHistoryIncomplete]), a record another run writes too ([ErrConflict]), a re-created stream
// ([ErrRecreated]), or the server refusing to answer. Whatever it returns, it first waits (up
// to PublishTimeout) for what it published and records how far it got.
func (r *Replay) Run(ctx context.Context) error {
	r.start = time.Now()
	defer func() { r.sum.Elapsed = time.Since(r.start) }()
	srcs, err := r.openSources(ctx)
	if err != nil {
		return err
	}
	shape, spec := r.spec(srcs)
	r.id = cmp.Or(r.cfg.ID, hashID(spec))
	r.sum.ID = r.id
	r.log = r.log.With().Str("replay", r.id).Logger()

	resumed := false
	if !r.cfg.DryRun {
		ctl, err := r.js.KeyValue(ctx, r.cfg.Names.Control)
		if err != nil {
			return fmt.Errorf("replay: opening the control bucket %s: %w", r.cfg.Names.Control, err)
		}
		r.st = &store{kv: ctl, key: wire.ReplayKey(r.id)}
		rec, ok, err := r.st.load(ctx)
		if err != nil {
			return err
		}
		if ok {
			if err := checkRecord(rec, shape, srcs, r.id); err != nil {
				return err
			}
			r.rec, resumed = rec, true
		}
	}
	if resumed && r.rec.Complete {
		r.sum.AlreadyComplete, r.sum.Complete = true, true
		r.fillSummary()
		r.report(true)
		return nil
	}
	if !resumed {
		rev, err := r.asOfRevision(ctx)
		if err != nil {
			return err
		}
		if err := r.resolve(ctx, srcs); err != nil {
			return err
		}
		now := time.Now().UTC()
		r.rec = record{Spec: spec, Shape: shape, AsOf: rev, Sources: srcs, Floors: map[string]uint64{}, Started: now}
	}
	r.sum.Resumed = resumed
	r.fillSummary()
	if err := r.loadTable(ctx); err != nil {
		return err
	}
	if r.tg, err = r.openTargets(ctx); err != nil {
		return err
	}
	r.sum.DeadLetters, r.rec.Dead = r.tg.dead, r.tg.dead
	r.prefixes = map[string]int{}
	for i, s := range r.rec.Sources {
		r.prefixes[r.idPrefix(s)] = i
	}
	if !r.cfg.DryRun {
		if err := r.openProgress(ctx, resumed); err != nil {
			return err
		}
	}
	for _, s := range r.rec.Sources {
		r.doneStart += s.done()
	}
	r.log.Debug().Uint64("as_of", r.rec.AsOf).Bool("resumed", resumed).Msg("replay started")

	var runErr error
	for i := range r.rec.Sources {
		if ctx.Err() != nil {
			break
		}
		if runErr = r.replaySource(ctx, i); runErr != nil {
			break
		}
	}
	complete := runErr == nil
	for _, s := range r.rec.Sources {
		complete = complete && s.Done >= s.Last
	}
	r.sum.Complete = complete
	if !r.cfg.DryRun {
		r.rec.Complete = complete
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := r.save(sctx); err != nil && runErr == nil {
			runErr = err
		}
	}
	r.report(true)
	return runErr
}

// spec describes everything that decides what the replay publishes: shape is all but the range
// and the as-of point, full adds them. The default id is the hash of full; a replay resumed by its
// id needs the same shape, and goes on with the range and revision it resolved when it started
// (a range given relative to now resolves differently every time).
func (r *Replay) spec(srcs []source) (shape, full string) {
	c := &r.cfg
	var b strings.Builder
	fmt.Fprintf(&b, "v1 layout=%s in=%s partitions=%d", c.Names.StreamLayout, c.Layout.In, c.Layout.Partitions)
	for _, s := range srcs {
		fmt.Fprintf(&b, " stream=%s@%s", s.Stream, s.Incarnation)
		if s.Filter != "" {
			fmt.Fprintf(&b, "[%s]", s.Filter)
		}
	}
	fmt.Fprintf(&b, " groups=%s", c.Names.Groups)
	if len(c.Partitions) > 0 {
		fmt.Fprintf(&b, " partitions=%v", c.Partitions)
	}
	if len(c.Devices) > 0 {
		fmt.Fprintf(&b, " devices=%s", strings.Join(c.Devices, ","))
	}
	fmt.Fprintf(&b, " into=%s out=%s dead=%s provenance=%t missing-history=%t", c.Into, c.Layout.Out, c.Layout.Unmapped, !c.NoProvenance, c.AllowMissingHistory)
	if hs := c.Layout.Headers(); len(hs) > 0 {
		fmt.Fprintf(&b, " headers=%q", hs) // only then: the replays of a layout without headers keep their ids
	}
	shape = b.String()
	point := func(seq uint64, t time.Time, none string) string {
		switch {
		case seq > 0:
			return strconv.FormatUint(seq, 10)
		case !t.IsZero():
			return t.UTC().Format(time.RFC3339Nano)
		}
		return none
	}
	full = fmt.Sprintf("%s from=%s to=%s as-of=%s", shape, point(c.FromSeq, c.FromTime, "-"), point(c.ToSeq, c.ToTime, "end"),
		point(c.AsOf.Revision, c.AsOf.Time, "now"))
	return shape, full
}

func hashID(spec string) string {
	h := sha256.Sum256([]byte(spec))
	return hex.EncodeToString(h[:8])
}

// checkRecord refuses to resume from a record of another replay, or of streams since re-created.
func checkRecord(rec record, shape string, srcs []source, id string) error {
	if rec.Shape == shape {
		return nil
	}
	if len(rec.Sources) == len(srcs) {
		for i, s := range srcs {
			if rec.Sources[i].Stream == s.Stream && rec.Sources[i].Incarnation != s.Incarnation {
				return fmt.Errorf("%w: stream %s is incarnation %s now, the replay %s began on %s: start a new replay (another --id)",
					ErrRecreated, s.Stream, s.Incarnation, id, rec.Sources[i].Incarnation)
			}
		}
	}
	return fmt.Errorf("%w: the id %s was used for another replay (%s): choose another --id", ErrConflict, id, rec.Shape)
}

// loadTable rebuilds the groups table as of the record's revision, and refuses (or, when
// allowed, warns about) devices whose value at that revision is gone from the history.
func (r *Replay) loadTable(ctx context.Context) error {
	snap, err := kv.AsOf(ctx, r.js, r.cfg.Names.Groups, r.rec.AsOf, r.cfg.Layout.Schema())
	if err != nil {
		return fmt.Errorf("replay: reading the groups table as of revision %d: %w", r.rec.AsOf, err)
	}
	r.snap = snap
	var unknown []string
	for _, d := range snap.UnknownKeys() {
		if r.devices == nil || r.devices[d] {
			unknown = append(unknown, d)
		}
	}
	r.sum.Unknown = len(unknown)
	if len(unknown) == 0 {
		if snap.Lost > 0 {
			r.log.Debug().Uint64("lost", snap.Lost).Msg("the groups bucket's history lost writes before the as-of revision, none that decides a device's group")
		}
		return nil
	}
	examples := unknown[:min(len(unknown), 5)]
	if !r.cfg.AllowMissingHistory {
		return fmt.Errorf("%w: bucket %s keeps %d values per key, and the value %d devices had at revision %d is gone (%s…): replay as of a later revision, create the bucket with more history (kvmapper setup --groups-history 64, for a new bucket), or allow it (--allow-missing-history dead-letters those devices' messages as %s)",
			ErrHistoryIncomplete, r.cfg.Names.Groups, snap.History, len(unknown), r.rec.AsOf, strings.Join(examples, ", "), ReasonHistoryMissing)
	}
	r.log.Warn().Int("devices", len(unknown)).Strs("examples", examples).Uint64("as_of", r.rec.AsOf).
		Msg("the group these devices had at the as-of revision is gone from the bucket's history; their messages are dead-lettered as " + ReasonHistoryMissing)
	return nil
}

// openProgress writes the record before anything is published: on a first run it claims the id
// (a second process starting the same replay fails on its write), on a resumed run it first
// reads what the targets already hold.
func (r *Replay) openProgress(ctx context.Context, resumed bool) error {
	for _, t := range r.tg.list() {
		s, err := r.js.Stream(ctx, t)
		if err != nil {
			return fmt.Errorf("replay: reading stream %s: %w", t, err)
		}
		last := s.CachedInfo().State.LastSeq
		if !resumed {
			r.rec.Floors[t] = last
		} else if _, ok := r.rec.Floors[t]; !ok {
			r.rec.Floors[t] = 0
		}
		r.maxAck[t] = last
	}
	if resumed {
		if err := r.scan(ctx); err != nil {
			return err
		}
	}
	return r.save(ctx)
}

func (t targets) list() []string {
	if t.dead == t.into || t.dead == "" {
		return []string{t.into}
	}
	return []string{t.into, t.dead}
}

// save writes the record with the floors as they are now.
func (r *Replay) save(ctx context.Context) error {
	if r.st == nil {
		return nil
	}
	floors := map[string]uint64{}
	for _, t := range r.tg.list() {
		floors[t] = r.maxAck[t]
	}
	for _, e := range r.q {
		if e.sent {
			floors[e.target] = min(floors[e.target], e.floor)
		}
	}
	if r.pinned != nil {
		ahead := false
		for i, till := range r.pinTill {
			if r.rec.Sources[i].Done < till {
				ahead = true
			}
		}
		if !ahead {
			r.pinned = nil
		}
		for t, f := range r.pinned {
			floors[t] = min(floors[t], f)
		}
	}
	r.rec.Floors = floors
	return r.st.save(ctx, &r.rec)
}

func (r *Replay) fillSummary() {
	r.sum.AsOf, r.sum.DeadLetters = r.rec.AsOf, r.rec.Dead
	r.sum.Ranges = r.sum.Ranges[:0]
	for _, s := range r.rec.Sources {
		r.sum.Ranges = append(r.sum.Ranges, Range{Stream: s.Stream, First: s.First, Last: s.Last})
	}
}

// report calls Config.Progress.
func (r *Replay) report(final bool) {
	if r.cfg.Progress == nil {
		return
	}
	p := Progress{ID: r.id, Final: final, Summary: r.sum}
	for _, s := range r.rec.Sources {
		p.Done += s.done()
		p.Total += s.size()
	}
	p.Elapsed = time.Since(r.start)
	if secs := p.Elapsed.Seconds(); secs > 0 && p.Done > r.doneStart {
		p.Rate = float64(p.Done-r.doneStart) / secs
		p.ETA = time.Duration(float64(p.Total-p.Done) / p.Rate * float64(time.Second))
	}
	r.cfg.Progress(p)
}

// warn logs at most one line per second per kind of problem (I6).
func (r *Replay) warn(kind string, f func(e *zerolog.Event)) {
	skipped, ok := r.warns.Allow(kind)
	if !ok {
		return
	}
	e := r.log.Warn()
	if skipped > 0 {
		e = e.Int("suppressed", skipped)
	}
	f(e)
}
