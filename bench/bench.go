package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

var (
	// ErrInvalidConfig is wrapped by [Run]'s error for a configuration it cannot run.
	ErrInvalidConfig = errors.New("bench: invalid config")
	// ErrForeignStreams is wrapped by [Run]'s error when the server holds streams the bench did
	// not create: it deletes and recreates its own, and refuses to run beside anyone else's.
	ErrForeignStreams = errors.New("bench: server holds streams the bench did not create")
)

// Kind names a sub-benchmark; [Config.Only] picks among them.
type Kind string

// The sub-benchmarks, in the order [Run] runs them.
const (
	Throughput Kind = "throughput"
	Latency    Kind = "latency"
	Mapping    Kind = "mapping"
	TableScale Kind = "table"
	Failover   Kind = "failover"
	Direct     Kind = "direct"
)

// All lists every sub-benchmark in the order [Run] runs them.
var All = []Kind{Throughput, Latency, Mapping, TableScale, Failover, Direct}

// Names are the streams and buckets one kvmapper run uses. The subjects are always the default
// ones: incoming.{device}.{event} → outgoing.{group}.{device}.{event}, unmapped.{device}.{event}.
type Names struct {
	subjects.Names
	Partitions int
	// NoProvenance runs the replica without the KVMapper-Prov header, to measure what it
	// costs.
	NoProvenance bool
	// StreamReplicas is the replica count of the streams and buckets ([Config.StreamReplicas]).
	StreamReplicas int
}

// ChildFunc returns the command that runs one kvmapper replica named id as a child process
// against url with the streams and buckets of n. The bench starts it, kills it with SIGKILL or
// stops it with SIGTERM, and waits for it.
type ChildFunc func(url, id string, n Names) *exec.Cmd

// Config says what to measure and how much. Zero fields mean the defaults given.
type Config struct {
	// URL of the NATS server. Required.
	URL string
	// ServerPIDs are the servers' process ids when they run on this machine: the bench reads
	// their CPU time from /proc to split the cost between servers and client. None: unknown.
	ServerPIDs []int
	// StreamReplicas is the replica count of every stream and bucket the bench creates: 3 on
	// the bench's own 3-node cluster (--cluster 3), the production default. Default 1.
	StreamReplicas int
	// Only lists the sub-benchmarks to run ([All] by default).
	Only []Kind

	// Messages is how many messages the throughput run maps. Default 1,000,000.
	Messages int
	// NaiveMessages caps the messages the naive mapper maps: at a few thousand a second it would
	// take minutes over the full set, and its rate is steady. Default 50,000.
	NaiveMessages int
	// Devices is how many devices publish, all mapped, in ten groups. Default 10,000.
	Devices int
	// Payload is the size of each message in bytes, at least 8. Default 128.
	Payload int
	// Partitions of INCOMING. Default 16.
	Partitions int
	// Replicas is how many in-process kvmapper replicas share the throughput run. Default 1.
	Replicas int
	// StreamLayout is how INCOMING is stored (subjects.SingleStream by default). With
	// subjects.PartitionStreams the server must map the device subjects into the partition
	// streams (the bench's own server does, when started with the same layout); the copy and
	// transform contenders then source every partition stream, and the naive mapper, whose one
	// consumer reads one stream, does not run.
	StreamLayout subjects.StreamLayout

	// Rate is the publish rate of the latency run, in messages a second. Default 10,000.
	Rate int
	// Duration of each latency run. Default 10s.
	Duration time.Duration
	// Changes is how many group changes the mapping-change run times. Default 200.
	Changes int
	// ChangeLoad is the background rate, in messages a second, while groups change. Default 5,000.
	ChangeLoad int
	// TableDevices is the size of the groups bucket of the table run. Default 1,000,000.
	TableDevices int
	// FailoverRate is the publish rate while a replica is killed. Default 2,000.
	FailoverRate int
	// FailoverReplicas is how many child replicas the failover run starts. Default 3.
	FailoverReplicas int

	// Contenders lists the throughput contenders to run, by name (see [Keys]); all by default.
	Contenders []ContenderName
	// Profile names the throughput contender the profiles below cover. Default [KVMapper].
	Profile ContenderName

	// Child makes the command of a kvmapper replica as a child process. Required for failover.
	Child ChildFunc

	// CPUProfile, if set, receives a CPU profile of this process during the kvmapper throughput
	// phase (from the replicas' table being loaded until OUTGOING holds every message), or the
	// phase of the contender Profile names.
	CPUProfile io.Writer
	// MemProfileBase and MemProfile, if set, receive the allocation profile at the start and at
	// the end of the kvmapper throughput phase: `go tool pprof -base` of the two shows only what
	// the phase allocated.
	MemProfileBase, MemProfile io.Writer
	// ServerProfile, if set, is called with true when the kvmapper throughput phase starts and
	// with false when it ends, to profile the server over the same span.
	ServerProfile func(start bool)
	// Progress receives a one-line progress display during long phases; nil for none.
	Progress io.Writer
	// Logger receives what the bench does, at debug level. Default: none.
	Logger zerolog.Logger
}

func (c *Config) setDefaults() error {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.Messages, 1_000_000)
	def(&c.NaiveMessages, 50_000)
	def(&c.Devices, 10_000)
	def(&c.Payload, 128)
	def(&c.Partitions, 16)
	def(&c.Replicas, 1)
	def(&c.Rate, 10_000)
	def(&c.Changes, 200)
	def(&c.ChangeLoad, 5_000)
	def(&c.TableDevices, 1_000_000)
	def(&c.FailoverRate, 2_000)
	def(&c.FailoverReplicas, 3)
	def(&c.StreamReplicas, 1)
	if c.Duration == 0 {
		c.Duration = 10 * time.Second
	}
	if len(c.Only) == 0 {
		c.Only = All
	}
	if len(c.Contenders) == 0 {
		for _, k := range Keys {
			c.Contenders = append(c.Contenders, k.Name)
		}
	}
	if c.Profile == "" {
		c.Profile = KVMapper
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, a...)...)
	}
	for _, o := range c.Only {
		if !slices.Contains(All, o) {
			return bad("no sub-benchmark %q (choose among %v)", o, All)
		}
	}
	for _, n := range c.Contenders {
		if !slices.ContainsFunc(Keys, func(k struct {
			Key  string
			Name ContenderName
		}) bool {
			return k.Name == n
		}) {
			return bad("no contender %q", n)
		}
	}
	switch {
	case !slices.ContainsFunc(Keys, func(k struct {
		Key  string
		Name ContenderName
	}) bool {
		return k.Name == c.Profile
	}):
		return bad("no contender %q to profile", c.Profile)
	case c.URL == "":
		return bad("URL is required")
	case c.Messages < 1, c.NaiveMessages < 1, c.Devices < 1, c.Replicas < 1, c.Rate < 1, c.Changes < 1,
		c.ChangeLoad < 1, c.TableDevices < 1, c.FailoverRate < 1, c.Duration < 0:
		return bad("sizes, rates and durations must be positive")
	case c.Payload < 8:
		return bad("payload %d must be at least 8 bytes (it carries a timestamp)", c.Payload)
	case c.FailoverReplicas < 2:
		return bad("failover needs at least 2 replicas, not %d", c.FailoverReplicas)
	case c.Child == nil && c.has(Failover):
		return bad("Child is required for %s", Failover)
	case c.StreamReplicas > 1 && (len(c.Only) != 1 || c.Only[0] != Throughput):
		return bad("streams of %d replicas (a cluster) run the throughput bench only: give --only throughput", c.StreamReplicas)
	}
	if _, err := subjects.NewLayout(inTemplate, outTemplate, unmappedTemplate, c.Partitions); err != nil {
		return bad("%v", err)
	}
	sl, err := subjects.ParseStreamLayout(string(c.StreamLayout))
	if err != nil {
		return bad("%v", err)
	}
	c.StreamLayout = sl
	return nil
}

func (c *Config) has(k Kind) bool { return slices.Contains(c.Only, k) }

// The subjects every run uses, and the names of what the bench creates. Everything it creates
// starts with benchPrefix (streams) or KV_bench- (buckets), which is how it knows its own.
const (
	inTemplate       = "incoming.{device}.{event}"
	outTemplate      = "outgoing.{group}.{device}.{event}"
	unmappedTemplate = "unmapped.{device}.{event}"

	benchPrefix    = "BENCH_"
	bucketPrefix   = "bench-"
	incomingStream = "BENCH_INCOMING"
	unmappedStream = "BENCH_UNMAPPED"
	groupsBucket   = "bench-groups"
	event          = "temp"
)

// Machine describes where the figures were taken.
type Machine struct {
	CPUs      int    `json:"cpus"`
	CPUModel  string `json:"cpu_model,omitempty"`
	GoVersion string `json:"go_version"`
	OS        string `json:"os"`
}

// Report holds the results of the sub-benchmarks that ran; the others are nil.
type Report struct {
	Machine Machine `json:"machine"`
	// StreamLayout is how INCOMING was stored: "single" or "streams".
	StreamLayout string             `json:"stream_layout"`
	Throughput   *ThroughputResult  `json:"throughput,omitempty"`
	Latency      *LatencyResult     `json:"latency,omitempty"`
	Mapping      *MappingResult     `json:"mapping_change,omitempty"`
	Table        *TableResult       `json:"table,omitempty"`
	Failover     *FailoverResult    `json:"failover,omitempty"`
	Direct       *DirectResult      `json:"direct,omitempty"`
	Elapsed      Seconds            `json:"elapsed_s"`
	Config       map[string]float64 `json:"config"`
}

// Seconds is a duration that prints, and encodes to JSON, as seconds.
type Seconds float64

func secs(d time.Duration) Seconds { return Seconds(d.Seconds()) }

// Millis is a duration that encodes to JSON as milliseconds.
type Millis float64

func millis(d time.Duration) Millis { return Millis(float64(d) / float64(time.Millisecond)) }

// Run runs the sub-benchmarks cfg asks for, one after the other, against the server at cfg.URL,
// and returns their results. It deletes and recreates the streams and buckets it uses (all named
// BENCH_… or bench-…) and refuses a server that holds any other stream. It blocks until done or
// ctx ends; on an error the report holds what finished before it.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	start := time.Now()
	rep := &Report{Machine: machine(), StreamLayout: string(cfg.StreamLayout), Config: map[string]float64{
		"messages": float64(cfg.Messages), "naive_messages": float64(min(cfg.NaiveMessages, cfg.Messages)),
		"devices": float64(cfg.Devices), "payload": float64(cfg.Payload), "partitions": float64(cfg.Partitions),
		"replicas": float64(cfg.Replicas), "rate": float64(cfg.Rate), "duration_s": cfg.Duration.Seconds(),
		"changes": float64(cfg.Changes), "change_load": float64(cfg.ChangeLoad), "table_devices": float64(cfg.TableDevices),
		"failover_rate": float64(cfg.FailoverRate), "failover_replicas": float64(cfg.FailoverReplicas),
		"stream_replicas": float64(cfg.StreamReplicas), "servers": float64(max(len(cfg.ServerPIDs), 1)),
	}}
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer e.close()
	defer func() { rep.Elapsed = secs(time.Since(start)) }()
	for _, name := range All {
		if !cfg.has(name) {
			continue
		}
		e.log.Debug().Str("benchmark", string(name)).Msg("starting")
		var err error
		switch name {
		case Throughput:
			rep.Throughput, err = e.throughput(ctx)
		case Latency:
			rep.Latency, err = e.latency(ctx)
		case Mapping:
			rep.Mapping, err = e.mapping(ctx)
		case TableScale:
			rep.Table, err = e.table(ctx)
		case Failover:
			rep.Failover, err = e.failover(ctx)
		case Direct:
			rep.Direct, err = e.direct(ctx)
		}
		e.prog.clear()
		if err != nil {
			return rep, fmt.Errorf("bench: %s: %w", name, err)
		}
	}
	return rep, nil
}

// env is what every sub-benchmark shares: the configuration, a connection, and the progress line.
type env struct {
	cfg  Config
	nc   *nats.Conn
	js   jetstream.JetStream
	lay  *subjects.Layout
	log  zerolog.Logger
	prog *progress
	runs int // kvmapper runs so far: each gets its own control bucket

	devices []string // device ids, "dev-00042"
	groupOf []string // group of devices[i]
}

func newEnv(ctx context.Context, cfg Config) (*env, error) {
	lay, err := subjects.NewLayout(inTemplate, outTemplate, unmappedTemplate, cfg.Partitions)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(cfg.URL, nats.Name("kvmapper bench"), nats.MaxReconnects(-1))
	if err != nil {
		return nil, fmt.Errorf("bench: connecting to %s: %w", cfg.URL, err)
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(publishWindow))
	if err != nil {
		nc.Close()
		return nil, err
	}
	e := &env{cfg: cfg, nc: nc, js: js, lay: lay, log: cfg.Logger, prog: newProgress(cfg.Progress)}
	if err := e.checkServer(ctx); err != nil {
		nc.Close()
		return nil, err
	}
	if err := e.cleanup(ctx); err != nil {
		nc.Close()
		return nil, err
	}
	width := len(fmt.Sprint(cfg.Devices - 1))
	e.devices = make([]string, cfg.Devices)
	e.groupOf = make([]string, cfg.Devices)
	for i := range e.devices {
		e.devices[i] = fmt.Sprintf("dev-%0*d", width, i)
		e.groupOf[i] = fmt.Sprintf("grp-%d", i%10)
	}
	return e, nil
}

func (e *env) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.cleanup(ctx); err != nil {
		e.log.Warn().Err(err).Msg("cleaning up")
	}
	e.nc.Close()
}

// checkServer refuses a server with streams the bench did not create.
func (e *env) checkServer(ctx context.Context) error {
	var foreign []string
	names := e.js.StreamNames(ctx)
	for n := range names.Name() {
		if !strings.HasPrefix(n, benchPrefix) && !strings.HasPrefix(n, "KV_"+bucketPrefix) {
			foreign = append(foreign, n)
		}
	}
	if err := names.Err(); err != nil {
		return fmt.Errorf("bench: listing streams: %w", err)
	}
	if len(foreign) > 0 {
		return fmt.Errorf("%w: %s; the bench deletes and recreates streams: point it at a server of its own (or run it without --server)",
			ErrForeignStreams, strings.Join(foreign, ", "))
	}
	return nil
}

// cleanup deletes every stream and bucket the bench creates.
func (e *env) cleanup(ctx context.Context) error {
	names := e.js.StreamNames(ctx)
	var mine []string
	for n := range names.Name() {
		if strings.HasPrefix(n, benchPrefix) || strings.HasPrefix(n, "KV_"+bucketPrefix) {
			mine = append(mine, n)
		}
	}
	if err := names.Err(); err != nil {
		return fmt.Errorf("bench: listing streams: %w", err)
	}
	for _, n := range mine {
		if err := e.js.DeleteStream(ctx, n); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("bench: deleting stream %s: %w", n, err)
		}
	}
	return nil
}

// names returns the streams and buckets of a fresh kvmapper run writing to outgoing: its own
// control bucket, so it starts from the beginning of INCOMING with no leases.
func (e *env) names(outgoing string) Names {
	e.runs++
	return Names{
		Names: subjects.Names{
			Incoming:     incomingStream,
			Outgoing:     outgoing,
			Unmapped:     unmappedStream,
			Groups:       groupsBucket,
			Control:      fmt.Sprintf("%scontrol-%d", bucketPrefix, e.runs),
			StreamLayout: e.cfg.StreamLayout,
		},
		Partitions:     e.cfg.Partitions,
		StreamReplicas: e.cfg.StreamReplicas,
	}
}

func machine() Machine {
	return Machine{CPUs: runtime.NumCPU(), CPUModel: cpuModel(), GoVersion: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH}
}
