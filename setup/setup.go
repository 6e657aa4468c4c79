package setup

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

var (
	// ErrMismatch is wrapped by [Ensure]'s error when an existing stream or bucket differs from
	// what kvmapper needs. The message names the difference and the fix.
	ErrMismatch = errors.New("setup: existing configuration differs")
	// ErrInvalidConfig is wrapped by [Ensure]'s error for a configuration it cannot apply.
	ErrInvalidConfig = errors.New("setup: invalid config")
)

// MinDuplicateWindow is the shortest OUTGOING duplicate window [Ensure] accepts: above the worst
// takeover, so anything a deposed owner sent is still recognised as a duplicate.
const MinDuplicateWindow = 2 * time.Minute

// Config names what [Ensure] creates or verifies. Zero fields mean the defaults given.
type Config struct {
	Layout *subjects.Layout // required
	// Names are the streams and buckets, and how INCOMING is stored: one stream with a subject
	// transform, or one stream per partition filled by an account mapping that [Ensure] probes
	// for, or [subjects.AutoLayout], which [Ensure] resolves with [ChooseLayout]; empty ones get
	// subjects.DefaultNames.
	subjects.Names
	// CallerSetsMapping says that the caller gives the server the account mapping of the
	// partition streams itself once they are chosen (`run --embedded`): for a new deployment,
	// [ChooseLayout] then picks [subjects.PartitionStreams] without probing.
	CallerSetsMapping bool
	// Replicas is the replica count of streams and buckets created. Default 1.
	Replicas int
	// Mode is what devices publish into: INCOMING ([wire.ModeStream], the default), or nothing
	// ([wire.ModeDirect]), when Ensure creates no INCOMING and checks the server with [CheckDirect].
	Mode wire.Mode
	// Receive says, in direct mode, whether the server must stamp the partitions with its account
	// mapping ([wire.ReceiveMapping], the default) or must not ([wire.ReceiveAll]).
	Receive wire.Receive
	// DuplicateWindow of OUTGOING and UNMAPPED when created. Default and minimum 2m.
	DuplicateWindow time.Duration
	// LimitMarkerTTL of the control bucket when created: how long expiry markers stay. Default 1m.
	LimitMarkerTTL time.Duration
	// GroupsHistory is how many values per key the groups bucket keeps when created, 1 to
	// [MaxGroupsHistory]: how far back `kvmapper replay --as-of` can map every device. Zero
	// means 5 and checks nothing; when set, an existing bucket that keeps fewer is an error
	// naming the fix.
	GroupsHistory int
	// Park, when set, makes [Ensure] create or verify the PARKED stream (Names.Parked) too; nil
	// leaves it alone.
	Park *ParkedStream
	// BalanceLeaders makes [Ensure], in the partition-streams layout on a cluster, move the
	// partition streams' leaderships until every server leads P/N of them, give or take one,
	// as the streams' replicas allow. It is best effort and bounded (15 s): what fails is a
	// report line beginning "warning:", never an error. `kvmapper setup` sets it; a replica's
	// own setup does not, so that replicas starting together, or restarting under load, move
	// no leaderships.
	BalanceLeaders bool
}

// DefaultGroupsHistory is the values per key of a groups bucket created without GroupsHistory.
const DefaultGroupsHistory = 5

// MaxGroupsHistory is the most values per key a KV bucket keeps (nats.go's KeyValueMaxHistory).
const MaxGroupsHistory = jetstream.KeyValueMaxHistory

// Defaults fills in the zero fields of c, and of the ParkedStream c.Park points to (in a copy).
func (c *Config) Defaults() {
	c.Names = c.Names.WithDefaults()
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.DuplicateWindow == 0 {
		c.DuplicateWindow = MinDuplicateWindow
	}
	if c.LimitMarkerTTL == 0 {
		c.LimitMarkerTTL = time.Minute
	}
	if c.Mode == "" {
		c.Mode = wire.ModeStream
	}
	if c.Receive == "" {
		c.Receive = wire.ReceiveMapping
	}
	if c.Park != nil {
		p := *c.Park
		p.defaults()
		c.Park = &p
	}
}

// Ensure creates what is missing and verifies what exists, and returns one line per stream and
// bucket saying which it did. It changes nothing that exists, but for the servers that lead the
// partition streams with [Config.BalanceLeaders] (and then one more line). Safe to run any
// number of times and from several replicas at once.
//
// In stream mode it resolves or checks the stream layout with [ChooseLayout] first (a layout
// that contradicts the one the control bucket records is an error wrapping
// [ErrLayoutConflict]) and, once everything exists, records it in the control bucket under
// [wire.LayoutKey], with one more report line.
func Ensure(ctx context.Context, js jetstream.JetStream, cfg Config) ([]string, error) {
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.DuplicateWindow < MinDuplicateWindow {
		return nil, fmt.Errorf("%w: duplicate window %v is below the minimum %v", ErrInvalidConfig, cfg.DuplicateWindow, MinDuplicateWindow)
	}
	if cfg.Mode == wire.ModeStream {
		choice, err := ChooseLayout(ctx, js, cfg)
		if err != nil {
			return nil, err
		}
		cfg.StreamLayout = choice.Layout
	}
	lay := cfg.Layout
	var report []string
	steps := []func() (string, error){
		func() (string, error) {
			if cfg.Mode == wire.ModeDirect {
				return ensureDirect(ctx, js, cfg)
			}
			return ensureIncoming(ctx, js, cfg)
		},
		func() (string, error) {
			return ensureOutput(ctx, js, cfg, cfg.Outgoing, lay.OutStreamSubject(), "republished messages")
		},
		func() (string, error) {
			return ensureOutput(ctx, js, cfg, cfg.Unmapped, lay.UnmappedStreamSubject(), "dead letters")
		},
		func() (string, error) { return ensureGroups(ctx, js, cfg) },
		func() (string, error) { return ensureControl(ctx, js, cfg) },
	}
	if cfg.Mode == wire.ModeStream {
		steps = append(steps, func() (string, error) { return recordLayout(ctx, js, cfg) })
	}
	if cfg.Park != nil {
		steps = append(steps, func() (string, error) { return ensureParked(ctx, js, cfg) })
	}
	if cfg.Mode == wire.ModeStream {
		steps = append(steps, func() (string, error) { return ensureFences(ctx, js, cfg) })
	}
	if cfg.BalanceLeaders && cfg.Mode == wire.ModeStream && cfg.StreamLayout == subjects.PartitionStreams {
		steps = append(steps, func() (string, error) { return spreadLeaders(ctx, js, cfg) })
	}
	for _, step := range steps {
		line, err := step()
		if err != nil {
			return report, err
		}
		if line != "" {
			report = append(report, line)
		}
	}
	return report, nil
}

func ensureIncoming(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	if cfg.StreamLayout == subjects.PartitionStreams {
		return ensurePartitionStreams(ctx, js, cfg)
	}
	lay := cfg.Layout
	want := jetstream.StreamConfig{
		Name:        cfg.Incoming,
		Description: "kvmapper input: device messages, partitioned by device on ingest",
		Subjects:    []string{lay.StreamSubject()},
		SubjectTransform: &jetstream.SubjectTransformConfig{
			Source:      lay.TransformSource(),
			Destination: lay.TransformDest(),
		},
		Storage:   jetstream.FileStorage,
		Retention: jetstream.LimitsPolicy,
		Replicas:  cfg.Replicas,
	}
	info, created, err := createOrGet(ctx, js, want)
	if err != nil {
		if _, perr := js.Stream(ctx, cfg.PartitionStream(0)); perr == nil {
			return "", fmt.Errorf("%w: the partition streams of the streams layout (%s …) exist and overlap %s: run with --layout streams, or remove them (`nats stream rm`) once mapped: %w",
				ErrMismatch, cfg.PartitionStream(0), cfg.Incoming, err)
		}
		return "", err
	}
	if created {
		return fmt.Sprintf("created stream %s: %s stored as %s", cfg.Incoming, lay.StreamSubject(), lay.TransformDest()), nil
	}
	got := info.Config
	if !slices.Contains(got.Subjects, lay.StreamSubject()) {
		return "", fmt.Errorf("%w: stream %s captures %v, not %q: fix its subjects with `nats stream edit %s --subjects %q`, or pass the --in template it was built for",
			ErrMismatch, cfg.Incoming, got.Subjects, lay.StreamSubject(), cfg.Incoming, lay.StreamSubject())
	}
	if got.SubjectTransform == nil || got.SubjectTransform.Destination != lay.TransformDest() {
		dest := "no subject transform"
		if got.SubjectTransform != nil {
			dest = fmt.Sprintf("the subject transform %q → %q", got.SubjectTransform.Source, got.SubjectTransform.Destination)
			if m := partitionsRE.FindStringSubmatch(got.SubjectTransform.Destination); m != nil && m[1] != fmt.Sprint(lay.Partitions) {
				return "", fmt.Errorf("%w: stream %s is partitioned into %s partitions (%s) but kvmapper runs with %d: run with --partitions %s, or recreate the stream (`nats stream rm %s`, then kvmapper setup) — the partition count is fixed once messages are stored",
					ErrMismatch, cfg.Incoming, m[1], got.SubjectTransform.Destination, lay.Partitions, m[1], cfg.Incoming)
			}
		}
		return "", fmt.Errorf("%w: stream %s has %s, kvmapper needs %q → %q: recreate it (`nats stream rm %s`, then kvmapper setup) or fix the --in template and --partitions",
			ErrMismatch, cfg.Incoming, dest, lay.TransformSource(), lay.TransformDest(), cfg.Incoming)
	}
	return fmt.Sprintf("stream %s ok: %s stored as %s", cfg.Incoming, lay.StreamSubject(), lay.TransformDest()), nil
}

var partitionsRE = regexp.MustCompile(`partition\((\d+),`)

func ensureOutput(ctx context.Context, js jetstream.JetStream, cfg Config, name, subject, what string) (string, error) {
	want := jetstream.StreamConfig{
		Name:        name,
		Description: "kvmapper output: " + what,
		Subjects:    []string{subject},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		Duplicates:  cfg.DuplicateWindow,
		Replicas:    cfg.Replicas,
		// The lanes write in batches where the stream allows them (lanes.Config.Singles): fast
		// ingest on one replica, atomic on several (fenceOutput allows those); only batches
		// keep a device's order through a leader change.
		AllowBatchPublish: true,
	}
	fenceOutput(&want)
	info, created, err := createOrGet(ctx, js, want)
	if err != nil {
		return "", err
	}
	if created {
		return fmt.Sprintf("created stream %s: %s, duplicate window %v, %s", name, subject, cfg.DuplicateWindow, WriteMode(want)), nil
	}
	got := info.Config
	if !slices.Contains(got.Subjects, subject) {
		return "", fmt.Errorf("%w: stream %s captures %v, not %q: add it with `nats stream edit %s --subjects %q`",
			ErrMismatch, name, got.Subjects, subject, name, subject)
	}
	if got.Duplicates < MinDuplicateWindow {
		return "", fmt.Errorf("%w: stream %s has a duplicate window of %v, below the %v a takeover needs to drop what a deposed owner sent: `nats stream edit %s --dupe-window %v`",
			ErrMismatch, name, got.Duplicates, MinDuplicateWindow, name, MinDuplicateWindow)
	}
	return fmt.Sprintf("stream %s ok: %s, duplicate window %v, %s", name, subject, got.Duplicates, WriteMode(got)), nil
}

// WriteMode says how the lanes write an output stream configured so: in atomic batches when it is
// replicated and allows them, in fast-ingest batches when it allows those, else with single
// publishes, and then what to change.
func WriteMode(c jetstream.StreamConfig) string {
	switch {
	case c.Replicas > 1 && c.AllowAtomicPublish:
		return "written in atomic batches"
	case c.AllowBatchPublish:
		return "written in fast-ingest batches"
	case c.AllowAtomicPublish:
		return "written in atomic batches"
	case c.Replicas > 1:
		return fmt.Sprintf("written with single publishes (a leader change can reverse a device's order: `nats stream edit %s --allow-batch`, atomic batches)", c.Name)
	}
	return fmt.Sprintf("written with single publishes (`nats stream edit %s --allow-fast` writes it faster, in fast batches)", c.Name)
}

func createOrGet(ctx context.Context, js jetstream.JetStream, want jetstream.StreamConfig) (*jetstream.StreamInfo, bool, error) {
	s, err := js.Stream(ctx, want.Name)
	if err == nil {
		return s.CachedInfo(), false, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, false, fmt.Errorf("setup: looking up stream %s: %w", want.Name, err)
	}
	s, err = js.CreateStream(ctx, want)
	if perr := placementError("stream "+want.Name, want.Replicas, err); perr != nil {
		return nil, false, perr
	}
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Another replica created it first.
		s, err = js.Stream(ctx, want.Name)
		if err != nil {
			return nil, false, fmt.Errorf("setup: looking up stream %s: %w", want.Name, err)
		}
		return s.CachedInfo(), false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("setup: creating stream %s: %w", want.Name, err)
	}
	return s.CachedInfo(), true, nil
}

func ensureGroups(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	kv, err := js.KeyValue(ctx, cfg.Groups)
	if err == nil {
		if cfg.GroupsHistory == 0 {
			return fmt.Sprintf("bucket %s ok", cfg.Groups), nil
		}
		st, err := kv.Status(ctx)
		if err != nil {
			return "", fmt.Errorf("setup: reading bucket %s: %w", cfg.Groups, err)
		}
		if h := int(st.History()); h < cfg.GroupsHistory {
			return "", fmt.Errorf("%w: bucket %s keeps %d values per key, fewer than the %d asked for: `nats kv edit %s --history %d` (older values already dropped stay dropped)",
				ErrMismatch, cfg.Groups, h, cfg.GroupsHistory, cfg.Groups, cfg.GroupsHistory)
		}
		return fmt.Sprintf("bucket %s ok, %d values per key", cfg.Groups, st.History()), nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return "", fmt.Errorf("setup: looking up bucket %s: %w", cfg.Groups, err)
	}
	_, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      cfg.Groups,
		Description: "kvmapper: device id → group id",
		History:     uint8(cmp.Or(cfg.GroupsHistory, DefaultGroupsHistory)),
		Storage:     jetstream.FileStorage,
		Replicas:    cfg.Replicas,
	})
	if perr := placementError("bucket "+cfg.Groups, cfg.Replicas, err); perr != nil {
		return "", perr
	}
	if err != nil && !errors.Is(err, jetstream.ErrBucketExists) {
		return "", fmt.Errorf("setup: creating bucket %s: %w", cfg.Groups, err)
	}
	return fmt.Sprintf("created bucket %s (device → group, %d values per key)", cfg.Groups, cmp.Or(cfg.GroupsHistory, DefaultGroupsHistory)), nil
}

func ensureControl(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	kv, err := js.KeyValue(ctx, cfg.Control)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		_, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket:         cfg.Control,
			Description:    "kvmapper: leases, members, checkpoints",
			History:        1,
			Storage:        jetstream.FileStorage,
			Replicas:       cfg.Replicas,
			LimitMarkerTTL: cfg.LimitMarkerTTL,
		})
		if err == nil {
			if err := awaitNewLeader(ctx, js, subjects.BucketStream(cfg.Control)); err != nil {
				return "", err
			}
			line := fmt.Sprintf("created bucket %s (leases, members, checkpoints)", cfg.Control)
			return markMode(ctx, js, cfg, line)
		}
		if perr := placementError("bucket "+cfg.Control, cfg.Replicas, err); perr != nil {
			return "", perr
		}
		if !errors.Is(err, jetstream.ErrBucketExists) {
			return "", fmt.Errorf("setup: creating bucket %s: %w", cfg.Control, err)
		}
		kv, err = js.KeyValue(ctx, cfg.Control)
	}
	if err != nil {
		return "", fmt.Errorf("setup: looking up bucket %s: %w", cfg.Control, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return "", fmt.Errorf("setup: reading bucket %s: %w", cfg.Control, err)
	}
	if st.LimitMarkerTTL() == 0 {
		return "", fmt.Errorf("%w: bucket %s was created without LimitMarkerTTL, which lease expiry needs: remove it (`nats kv rm %s`, checkpoints are lost and partitions restart from the beginning of INCOMING) and run kvmapper setup, or name another with --control-bucket",
			ErrMismatch, cfg.Control, cfg.Control)
	}
	return markMode(ctx, js, cfg, fmt.Sprintf("bucket %s ok", cfg.Control))
}

// awaitNewLeader waits until a stream just created has a leader: a replicated one elects it after
// the create's answer, and a read of it until then gets "no responders".
func awaitNewLeader(ctx context.Context, js jetstream.JetStream, stream string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		s, err := js.Stream(ctx, stream)
		if err == nil && (s.CachedInfo().Cluster == nil || s.CachedInfo().Cluster.Leader != "") {
			return nil
		}
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("setup: stream %s has no leader 30s after its creation: %w (is the cluster electing? `nats stream info %s`)", stream, ctx.Err(), stream)
		}
	}
}

// placementError explains, for a create that failed because the servers cannot hold replicas
// copies of what (a single server, or a cluster with too few servers up), what to do instead;
// it returns nil for any other error. It wraps [ErrInvalidConfig].
func placementError(what string, replicas int, err error) error {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return nil
	}
	switch apiErr.ErrorCode {
	case errCodeReplicasNotSupported:
		return fmt.Errorf("%w: creating %s with %d replicas: the server is not in a JetStream cluster (%s): run setup with --stream-replicas 1, or start a cluster of at least %d servers (docs/cluster.md: Production on a cluster)",
			ErrInvalidConfig, what, replicas, apiErr.Description, replicas)
	case errCodeNoPeers, errCodeInsufficientResources:
		return fmt.Errorf("%w: creating %s with %d replicas: the cluster cannot place them (%s): it needs %d servers with JetStream, up and with room (`nats server report jetstream` lists them), or a lower --stream-replicas",
			ErrInvalidConfig, what, replicas, apiErr.Description, replicas)
	}
	return nil
}

// nats-server's error codes for a stream it cannot place (JSStreamReplicasNotSupportedErr,
// JSClusterNoPeersErrF, JSInsufficientResourcesErr), which nats.go has no constants for.
const (
	errCodeReplicasNotSupported  jetstream.ErrorCode = 10074
	errCodeNoPeers               jetstream.ErrorCode = 10005
	errCodeInsufficientResources jetstream.ErrorCode = 10023
)

// Apply is `kvmapper setup`: it resolves cfg's layout ([ChooseLayout]; a choice --layout auto
// made is said in stream mode), then runs [Ensure], and writes to w what they did, one line each,
// and when a faster layout was not chosen, why and the server configuration it needs.
func Apply(ctx context.Context, js jetstream.JetStream, cfg Config, w io.Writer) error {
	auto := cfg.StreamLayout == subjects.AutoLayout
	choice, err := ChooseLayout(ctx, js, cfg)
	if err != nil {
		return err
	}
	cfg.StreamLayout = choice.Layout
	if auto && cfg.Mode == wire.ModeStream {
		fmt.Fprintf(w, "layout %s (--layout auto): %s\n", choice.Layout, choice.Why)
	}
	lines, err := Ensure(ctx, js, cfg)
	for _, l := range lines {
		fmt.Fprintln(w, l)
	}
	if err == nil {
		fmt.Fprintf(w, "values in bucket %s: %s\n", cfg.Groups, cfg.Layout.Schema().Describe())
	}
	if err == nil && choice.Faster != "" {
		fmt.Fprintf(w, "\n%s.\n\n%s", choice.Faster, MappingConfig(cfg.Layout))
	}
	return err
}

// get reads key from kv, waiting out "no responders" for up to 10 s: a bucket just created on a
// cluster can have its leader while no replica answers direct gets yet (seen: setup on a new
// 3-node cluster, "reading mode in bucket kvmapper: nats: no responders available for request").
func get(ctx context.Context, kv jetstream.KeyValue, key string) (jetstream.KeyValueEntry, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		e, err := kv.Get(ctx, key)
		if !errors.Is(err, nats.ErrNoResponders) || time.Now().After(deadline) {
			return e, err
		}
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, err
		}
	}
}
