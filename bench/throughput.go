package bench

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
)

// ContenderName names a contender of the throughput run, as its report shows it; [Keys] gives
// each a short key.
type ContenderName string

// The contenders of the throughput run.
const (
	KVMapper ContenderName = "kvmapper"
	// KVMapperBare is kvmapper without provenance headers (--no-provenance): what they cost.
	KVMapperBare ContenderName = "kvmapper, no provenance"
	Copy         ContenderName = "server-side copy"
	Transform    ContenderName = "server-side transform"
	Naive        ContenderName = "naive mapper"
)

// Contender is one way of getting INCOMING into a target stream, timed.
type Contender struct {
	Name ContenderName `json:"name"`
	// Messages the target stream held when timing stopped.
	Messages uint64 `json:"messages"`
	// MsgsPerSec is the steady rate: messages stored after the first poll that saw any, over the
	// time from that poll to the one that saw them all (polls every 10ms).
	MsgsPerSec float64 `json:"msgs_per_s"`
	// Seconds from the first message in the target to the last.
	Seconds Seconds `json:"seconds"`
	// Startup is the time from the start to the first message in the target: for kvmapper, from
	// the table being loaded, through the election, to the first publish.
	Startup Seconds `json:"startup_s"`
	// ServerCPU and ClientCPU are the CPU seconds the server process and this process spent over
	// the run. ServerCPU is 0 when the server's process is unknown.
	ServerCPU Seconds `json:"server_cpu_s"`
	ClientCPU Seconds `json:"client_cpu_s"`
	// StoredBytes is what the target stream stored (its state's bytes: subjects, headers and
	// payloads, as nats stream info shows them), on each server that holds a replica of it; for
	// kvmapper on a cluster, its fence records too (one per partition).
	StoredBytes uint64 `json:"stored_bytes"`
}

// ServerCPUPerMsg is the servers' CPU time per message in microseconds.
func (c Contender) ServerCPUPerMsg() float64 {
	if c.Messages == 0 {
		return 0
	}
	return float64(c.ServerCPU) * 1e6 / float64(c.Messages)
}

// StoredPerMsg is the bytes the target stream stores per message.
func (c Contender) StoredPerMsg() float64 {
	if c.Messages == 0 {
		return 0
	}
	return float64(c.StoredBytes) / float64(c.Messages)
}

// CPUPerMsg is the CPU time, server and client together, per message in microseconds.
func (c Contender) CPUPerMsg() float64 {
	if c.Messages == 0 {
		return 0
	}
	return float64(c.ServerCPU+c.ClientCPU) * 1e6 / float64(c.Messages)
}

// ThroughputResult is what the throughput run measured.
type ThroughputResult struct {
	Messages   int `json:"messages"`
	Devices    int `json:"devices"`
	Partitions int `json:"partitions"`
	Replicas   int `json:"replicas"`
	Payload    int `json:"payload_bytes"`
	// FillMsgsPerSec is how fast the bench's own async publishes filled INCOMING.
	FillMsgsPerSec float64     `json:"fill_msgs_per_s"`
	Contenders     []Contender `json:"contenders"`
	// Ratio is kvmapper's rate divided by each other contender's.
	Ratio map[ContenderName]float64 `json:"ratio"`
	// AllocsPerMsg and BytesPerMsg are this process's heap allocations during the kvmapper run
	// (runtime.MemStats Mallocs and TotalAlloc deltas, from the tables being loaded until OUTGOING
	// held every message) per message: the whole pipeline, nats.go included.
	AllocsPerMsg float64 `json:"allocs_per_msg"`
	BytesPerMsg  float64 `json:"bytes_per_msg"`
}

// Get returns the contender named name, or the zero Contender.
func (r *ThroughputResult) Get(name ContenderName) Contender {
	for _, c := range r.Contenders {
		if c.Name == name {
			return c
		}
	}
	return Contender{}
}

func (e *env) throughput(ctx context.Context) (*ThroughputResult, error) {
	n := e.cfg.Messages
	res := &ThroughputResult{Messages: n, Devices: e.cfg.Devices, Partitions: e.cfg.Partitions, Replicas: e.cfg.Replicas,
		Payload: e.cfg.Payload, Ratio: map[ContenderName]float64{}}
	if err := e.createIncoming(ctx); err != nil {
		return nil, err
	}
	if err := e.purgeIncoming(ctx); err != nil {
		return nil, err
	}
	var err error
	if res.FillMsgsPerSec, err = e.fill(ctx, n); err != nil {
		return nil, err
	}
	runs := []struct {
		name ContenderName
		run  func(context.Context) (Contender, error)
	}{
		{Copy, func(ctx context.Context) (Contender, error) { return e.source(ctx, Copy, "BENCH_OUT_COPY", nil) }},
		{Transform, func(ctx context.Context) (Contender, error) {
			return e.source(ctx, Transform, "BENCH_OUT_TRANSFORM", []jetstream.SubjectTransformConfig{{
				Source: "incoming.*.*.*", Destination: "outgoing.grp.{{wildcard(2)}}.{{wildcard(3)}}",
			}})
		}},
		{KVMapper, func(ctx context.Context) (Contender, error) { return e.kvmapper(ctx, res, KVMapper) }},
		{KVMapperBare, func(ctx context.Context) (Contender, error) { return e.kvmapper(ctx, res, KVMapperBare) }},
		{HandWritten, e.handWritten},
		{RelayAsync, e.relayAsync},
		{RelayCeiling, e.relayCeiling},
		{RelayAtomic, e.relayAtomic},
		{Naive, e.naive},
	}
	for _, r := range runs {
		if !slices.Contains(e.cfg.Contenders, r.name) || r.name == Naive && e.cfg.StreamLayout == subjects.PartitionStreams {
			continue // not asked for, or the naive mapper, whose one consumer reads one stream
		}
		c, err := r.run(ctx)
		if err != nil {
			return res, fmt.Errorf("%s: %w", r.name, err)
		}
		e.log.Debug().Str("contender", string(c.Name)).Float64("msgs_per_s", c.MsgsPerSec).Msg("done")
		res.Contenders = append(res.Contenders, c)
	}
	k := res.Get(KVMapper).MsgsPerSec
	for _, c := range res.Contenders {
		if k > 0 && c.Name != KVMapper && c.MsgsPerSec > 0 {
			res.Ratio[c.Name] = k / c.MsgsPerSec
		}
	}
	return res, nil
}

// source times a stream sourcing INCOMING, with subject transforms or none.
func (e *env) source(ctx context.Context, name ContenderName, stream string, transforms []jetstream.SubjectTransformConfig) (Contender, error) {
	msgs, _, err := e.incomingState(ctx)
	if err != nil {
		return Contender{}, err
	}
	// Every stream holding INCOMING messages, as kvmapper reads every one.
	var sources []*jetstream.StreamSource
	for _, in := range e.incoming().IncomingStreams(e.cfg.Partitions) {
		sources = append(sources, &jetstream.StreamSource{Name: in, SubjectTransforms: transforms})
	}
	cpu := e.cpuStart()
	start := time.Now()
	_, err = e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name:     stream,
		Storage:  jetstream.FileStorage,
		Sources:  sources,
		Replicas: e.cfg.StreamReplicas,
	})
	if err != nil {
		return Contender{}, fmt.Errorf("creating %s: %w", stream, err)
	}
	w, err := e.waitCount(ctx, stream, msgs, start, string(name))
	if err != nil {
		return Contender{}, err
	}
	server, client := cpu.stop()
	c, err := e.contender(ctx, name, stream, w)
	if err != nil {
		return c, err
	}
	c.ServerCPU, c.ClientCPU = server, client
	return c, e.deleteStream(ctx, stream)
}

// contender is what the run of name measured, with the bytes its target stream stores.
func (e *env) contender(ctx context.Context, name ContenderName, stream string, w waited) (Contender, error) {
	c := Contender{Name: name, Messages: w.messages, MsgsPerSec: w.rate, Seconds: secs(w.done.Sub(w.first)), Startup: Seconds(w.startup.Seconds())}
	info, err := e.streamInfo(ctx, stream)
	if err != nil {
		return c, fmt.Errorf("reading what %s stores: %w", stream, err)
	}
	c.StoredBytes = info.State.Bytes
	return c, nil
}

func (e *env) streamInfo(ctx context.Context, name string) (*jetstream.StreamInfo, error) {
	s, err := e.js.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	return s.Info(ctx)
}

// kvmapper times the in-process replicas from the moment their tables are loaded. The run named
// KVMapperBare leaves the provenance headers out; only the KVMapper run counts allocations.
func (e *env) kvmapper(ctx context.Context, res *ThroughputResult, name ContenderName) (Contender, error) {
	msgs, _, err := e.incomingState(ctx)
	if err != nil {
		return Contender{}, err
	}
	main, prof := name == KVMapper, name == e.cfg.Profile
	names := e.names("BENCH_OUT_KVMAPPER")
	names.NoProvenance = !main
	if err := e.ensure(ctx, names); err != nil {
		return Contender{}, err
	}
	e.prog.show("kvmapper: starting %d replica(s)", e.cfg.Replicas)
	m, err := e.startMappers(ctx, names, e.cfg.Replicas)
	if err != nil {
		return Contender{}, err
	}
	defer func() {
		if m != nil {
			_ = m.stop()
		}
	}()
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	if prof {
		if err := e.profiles(true); err != nil {
			return Contender{}, err
		}
	}
	// On a cluster setup fences OUTGOING: it also holds one fence record per partition, which
	// the replicas write as they claim, before their first message.
	want := msgs
	if e.cfg.StreamReplicas > 1 {
		want += uint64(e.cfg.Partitions)
	}
	cpu := e.cpuStart()
	start := time.Now()
	w, werr := e.waitCount(ctx, names.Outgoing, want, start, string(name))
	server, client := cpu.stop()
	runtime.ReadMemStats(&ms1)
	if prof {
		if err := e.profiles(false); err != nil && werr == nil {
			werr = err
		}
	}
	if werr != nil {
		return Contender{}, werr
	}
	c, err := e.contender(ctx, name, names.Outgoing, w)
	if err != nil {
		return c, err
	}
	c.Messages -= want - msgs // the fence records are no messages of the devices'
	c.ServerCPU, c.ClientCPU = server, client
	if main {
		res.AllocsPerMsg = float64(ms1.Mallocs-ms0.Mallocs) / float64(w.messages)
		res.BytesPerMsg = float64(ms1.TotalAlloc-ms0.TotalAlloc) / float64(w.messages)
	}
	err = m.stop()
	m = nil
	if err != nil {
		return c, err
	}
	// On a cluster UNMAPPED also holds a fence record per partition: count what is not one.
	un, err := e.streamInfo(ctx, names.Unmapped)
	if err != nil {
		return c, err
	}
	fences, err := e.js.Stream(ctx, names.Unmapped)
	if err != nil {
		return c, err
	}
	fi, err := fences.Info(ctx, jetstream.WithSubjectFilter(subjects.FenceFilter(names.Unmapped)))
	if err != nil {
		return c, err
	}
	var nfences uint64
	for _, n := range fi.State.Subjects {
		nfences += n
	}
	if n := un.State.Msgs - nfences; n != 0 {
		return c, fmt.Errorf("%d messages went to %s; every device is mapped", n, names.Unmapped)
	}
	return c, e.dropRun(ctx, names)
}

// dropRun deletes what one kvmapper run wrote: its OUTGOING and its control bucket.
func (e *env) dropRun(ctx context.Context, names Names) error {
	if err := e.deleteStream(ctx, names.Outgoing); err != nil {
		return err
	}
	return e.deleteStream(ctx, "KV_"+names.Control)
}

// profiles starts (or stops) the profiles the config asks for around the kvmapper phase.
func (e *env) profiles(start bool) error {
	c := e.cfg
	if start {
		if c.MemProfileBase != nil {
			runtime.GC()
			if err := pprof.Lookup("allocs").WriteTo(c.MemProfileBase, 0); err != nil {
				return err
			}
		}
		if c.CPUProfile != nil {
			if err := pprof.StartCPUProfile(c.CPUProfile); err != nil {
				return err
			}
		}
		if c.ServerProfile != nil {
			c.ServerProfile(true)
		}
		return nil
	}
	if c.ServerProfile != nil {
		c.ServerProfile(false)
	}
	if c.CPUProfile != nil {
		pprof.StopCPUProfile()
	}
	if c.MemProfile != nil {
		runtime.GC()
		return pprof.Lookup("allocs").WriteTo(c.MemProfile, 0)
	}
	return nil
}

// naive is the mapper one writes first: one durable pull consumer, and for each message a lookup,
// a synchronous publish and an ack.
func (e *env) naive(ctx context.Context) (Contender, error) {
	const stream = "BENCH_OUT_NAIVE"
	k := min(e.cfg.NaiveMessages, e.cfg.Messages)
	nc, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench naive"))
	if err != nil {
		return Contender{}, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return Contender{}, err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: stream, Subjects: []string{e.lay.OutStreamSubject()}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute,
		Replicas: e.cfg.StreamReplicas,
	}); err != nil {
		return Contender{}, fmt.Errorf("creating %s: %w", stream, err)
	}
	group := make(map[string]string, len(e.devices))
	for i, d := range e.devices {
		group[d] = e.groupOf[i]
	}
	cpu := e.cpuStart()
	start := time.Now()
	cons, err := js.CreateOrUpdateConsumer(ctx, incomingStream, jetstream.ConsumerConfig{
		Durable: "bench-naive", AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 1000,
	})
	if err != nil {
		return Contender{}, err
	}
	nctx, stop := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- naiveLoop(nctx, js, cons, group, k) }()
	w, err := e.waitCount(ctx, stream, uint64(k), start, string(Naive))
	stop()
	if lerr := <-errc; err == nil && lerr != nil && !errors.Is(lerr, context.Canceled) {
		err = lerr
	}
	if err != nil {
		return Contender{}, err
	}
	server, client := cpu.stop()
	c, err := e.contender(ctx, Naive, stream, w)
	if err != nil {
		return c, err
	}
	c.ServerCPU, c.ClientCPU = server, client
	if err := js.DeleteConsumer(ctx, incomingStream, "bench-naive"); err != nil {
		return c, err
	}
	return c, e.deleteStream(ctx, stream)
}

func naiveLoop(ctx context.Context, js jetstream.JetStream, cons jetstream.Consumer, group map[string]string, k int) error {
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	defer it.Stop()
	stopIt := context.AfterFunc(ctx, it.Stop)
	defer stopIt()
	for done := 0; done < k; done++ {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		// incoming.<partition>.<device>.<event>
		tok := strings.Split(m.Subject(), ".")
		if len(tok) != 4 {
			return fmt.Errorf("unexpected subject %q", m.Subject())
		}
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		out := &nats.Msg{Subject: "outgoing." + group[tok[2]] + "." + tok[2] + "." + tok[3], Header: msgID(md.Sequence.Stream), Data: m.Data()}
		if _, err := js.PublishMsg(ctx, out); err != nil {
			return err
		}
		if err := m.Ack(); err != nil {
			return err
		}
	}
	return nil
}
