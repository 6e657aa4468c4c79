package bench

import (
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
	"golang.org/x/sync/errgroup"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// The paths the direct run compares, and the subjects its devices publish to for each direct
// mode. The bench's own server maps DirectMappedIn into partitions (kvmapper server
// --direct-in); nothing maps DirectAllIn, which the "all" receive mode needs.
const (
	PathStraight     = "straight into OUTGOING"
	PathStream       = "stream mode (INCOMING, then kvmapper)"
	PathDirectMapped = "direct mode, mapping"
	PathDirectAll    = "direct mode, all"
	// PathDirectProvenance is PathDirectMapped with the provenance headers: what they cost.
	PathDirectProvenance = "direct mode, mapping, provenance"

	DirectMappedIn = "direct.{device}.{event}"
	DirectAllIn    = "directall.{device}.{event}"

	directOutgoing = "BENCH_OUT_DIRECT"
)

// DirectPath is one way a device's message gets into OUTGOING, measured twice: paced at the
// configured rate for latency, then as fast as publishers keeping a window of acknowledgements
// in flight can go.
type DirectPath struct {
	Name string `json:"name"`
	// Ack is publish → the device's PubAck (from INCOMING in stream mode, from OUTGOING
	// otherwise); Delivery is publish → delivery of the message from OUTGOING to a subscriber.
	Ack      Percentiles `json:"ack"`
	Delivery Percentiles `json:"delivery"`
	Sent     int         `json:"sent"`
	// Errors counts the publishes of both runs answered with an error or not answered.
	Errors int64 `json:"errors"`
	// AckedPerSec is acknowledgements a second with the window in flight; StoredPerSec is how
	// fast OUTGOING held all of them (for stream mode: INCOMING, then kvmapper).
	AckedPerSec  float64 `json:"acked_msgs_per_s"`
	StoredPerSec float64 `json:"stored_msgs_per_s"`
	// ServerCPU and ClientCPU are the CPU seconds of the windowed run; ClientCPU is this whole
	// process: publishers, subscriber and in-process replicas.
	ServerCPU Seconds `json:"server_cpu_s"`
	ClientCPU Seconds `json:"client_cpu_s"`
	Messages  int     `json:"messages"`
}

// CPUPerMsg is the windowed run's CPU time, server and client together, per message in µs.
func (p DirectPath) CPUPerMsg() float64 {
	if p.Messages == 0 {
		return 0
	}
	return float64(p.ServerCPU+p.ClientCPU) * 1e6 / float64(p.Messages)
}

// DirectResult compares direct mode with stream mode and with publishing straight into OUTGOING.
type DirectResult struct {
	Rate       int          `json:"rate"`
	Duration   Seconds      `json:"duration_s"`
	Warmup     Seconds      `json:"warmup_s"`
	Messages   int          `json:"messages"`
	Publishers int          `json:"publishers"`
	Window     int          `json:"window"`
	Replicas   int          `json:"replicas"`
	Paths      []DirectPath `json:"paths"`
	// Added is each path's Ack latency minus straight's, percentile by percentile; Ratio its
	// AckedPerSec over straight's.
	Added map[string]Percentiles `json:"added_ack"`
	Ratio map[string]float64     `json:"ratio"`
	// Skipped names paths that could not run, with the reason.
	Skipped map[string]string `json:"skipped,omitempty"`
}

// directPublishers and directWindow shape the windowed run: so many publishers, each with so many
// acknowledgements outstanding; directMessages is what they send together.
const (
	directPublishers = 4
	directWindow     = 256
	directMessages   = 200_000
)

func (e *env) direct(ctx context.Context) (*DirectResult, error) {
	if err := e.createIncoming(ctx); err != nil {
		return nil, err
	}
	if err := e.purgeIncoming(ctx); err != nil {
		return nil, err
	}
	msgs := min(directMessages, e.cfg.Messages)
	res := &DirectResult{Rate: e.cfg.Rate, Duration: secs(e.cfg.Duration), Warmup: secs(e.warmup()), Messages: msgs,
		Publishers: directPublishers, Window: directWindow, Replicas: e.cfg.Replicas,
		Added: map[string]Percentiles{}, Ratio: map[string]float64{}, Skipped: map[string]string{}}
	type path struct {
		name, in string
		run      func(ctx context.Context, names Names) (*replicas, error)
	}
	paths := []path{
		{PathStraight, "", nil},
		{PathStream, inTemplate, func(ctx context.Context, n Names) (*replicas, error) {
			return e.startReplicas(ctx, n, func(ctx context.Context, id string, ready func(*mapper.Replica)) error {
				return runStreamReplica(ctx, e.log, e.cfg.URL, id, n, ready)
			})
		}},
		{PathDirectMapped, DirectMappedIn, e.directRun(DirectMappedIn, wire.ReceiveMapping, false)},
		{PathDirectAll, DirectAllIn, e.directRun(DirectAllIn, wire.ReceiveAll, false)},
		{PathDirectProvenance, DirectMappedIn, e.directRun(DirectMappedIn, wire.ReceiveMapping, true)},
	}
	for _, pth := range paths {
		names := e.names(directOutgoing)
		if err := e.ensure(ctx, names); err != nil {
			return nil, err
		}
		var reps *replicas
		if pth.run != nil {
			var err error
			if reps, err = pth.run(ctx, names); err != nil {
				if pth.in == DirectMappedIn && errors.Is(err, setup.ErrNoMapping) {
					res.Skipped[pth.name] = "the server lacks the mapping of " + DirectMappedIn + " (the bench's own server has it)"
					_ = e.dropRun(ctx, names)
					continue
				}
				return nil, fmt.Errorf("%s: %w", pth.name, err)
			}
		}
		subject := e.outSubject
		if pth.in != "" {
			prefix := strings.SplitN(pth.in, ".", 2)[0] + "."
			subject = func(i int) string { return prefix + e.devices[i] + "." + event }
		}
		r, err := e.directPath(ctx, pth.name, subject, msgs)
		if reps != nil {
			if serr := reps.stop(); err == nil {
				err = serr
			}
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", pth.name, err)
		}
		res.Paths = append(res.Paths, r)
		if err := e.dropRun(ctx, names); err != nil {
			return nil, err
		}
	}
	straight := res.Paths[0]
	for _, p := range res.Paths[1:] {
		res.Added[p.Name] = p.Ack.minus(straight.Ack)
		if straight.AckedPerSec > 0 {
			res.Ratio[p.Name] = p.AckedPerSec / straight.AckedPerSec
		}
	}
	return res, nil
}

// directRun returns how to start the in-process direct-mode replicas of one path.
func (e *env) directRun(in string, r wire.Receive, provenance bool) func(ctx context.Context, n Names) (*replicas, error) {
	return func(ctx context.Context, n Names) (*replicas, error) {
		lay, err := subjects.NewLayout(in, outTemplate, unmappedTemplate, n.Partitions)
		if err != nil {
			return nil, err
		}
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = setup.CheckDirect(sctx, e.js, setup.Config{Layout: lay, Names: n.Names, Mode: wire.ModeDirect, Receive: r})
		cancel()
		if err != nil {
			return nil, err
		}
		return e.startReplicas(ctx, n, func(ctx context.Context, id string, ready func(*mapper.Replica)) error {
			return runDirectReplica(ctx, e.log, e.cfg.URL, id, n, lay, r, provenance, ready)
		})
	}
}

// directPath measures one path: the paced latency run, then the windowed throughput run.
func (e *env) directPath(ctx context.Context, name string, subject func(i int) string, msgs int) (DirectPath, error) {
	res := DirectPath{Name: name}
	s, err := e.js.Stream(ctx, directOutgoing)
	if err != nil {
		return res, err
	}
	if err := s.Purge(ctx); err != nil {
		return res, err
	}
	// Latency: one publisher at the configured rate, a subscriber timing deliveries.
	sub, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench subscriber"))
	if err != nil {
		return res, err
	}
	defer sub.Close()
	var mu sync.Mutex
	var delivery []time.Duration
	delivered := 0
	ds, err := sub.Subscribe("outgoing.>", func(m *nats.Msg) {
		now := time.Now()
		t, ok := stamp(m.Data)
		mu.Lock()
		delivered++
		if ok && len(m.Data) > 8 && m.Data[8] == 1 {
			delivery = append(delivery, now.Sub(t))
		}
		mu.Unlock()
	})
	if err != nil {
		return res, err
	}
	if err := ds.SetPendingLimits(-1, -1); err != nil {
		return res, err
	}
	if err := sub.Flush(); err != nil {
		return res, err
	}
	pub, err := newAckPublisher(e.cfg.URL, 0)
	if err != nil {
		return res, err
	}
	defer pub.close()
	warm := e.warmup()
	start := time.Now()
	interval := time.Second / time.Duration(e.cfg.Rate)
	end := start.Add(e.cfg.Duration + warm)
	for i := 0; ; i++ {
		due := start.Add(time.Duration(i) * interval)
		if !due.Before(end) {
			break
		}
		if d := time.Until(due); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return res, ctx.Err()
			}
		}
		if err := pub.publish(subject(i%len(e.devices)), e.cfg.Payload, !due.Before(start.Add(warm))); err != nil {
			return res, err
		}
		if i%1000 == 0 {
			e.prog.show("%s, latency: %.0f of %.0f s", name, time.Since(start).Seconds(), (e.cfg.Duration + warm).Seconds())
		}
	}
	if err := pub.wait(ctx, 30*time.Second); err != nil {
		return res, fmt.Errorf("latency run: %w", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		got := delivered
		mu.Unlock()
		if got >= pub.sent || time.Now().After(deadline) {
			break
		}
		select {
		case <-time.After(10 * time.Millisecond):
		case <-ctx.Done():
			return res, ctx.Err()
		}
	}
	_ = ds.Unsubscribe()
	mu.Lock()
	res.Delivery = percentiles(delivery)
	mu.Unlock()
	res.Ack, res.Sent, res.Errors = percentiles(pub.latencies()), pub.sent, pub.errs.Load()

	// Throughput: publishers keeping a window of acknowledgements in flight each.
	if err := s.Purge(ctx); err != nil {
		return res, err
	}
	cpu := e.cpuStart()
	g, gctx := errgroup.WithContext(ctx)
	var acked, errs atomic.Int64
	tstart := time.Now()
	for w := range directPublishers {
		g.Go(func() error {
			p, err := newAckPublisher(e.cfg.URL, directWindow)
			if err != nil {
				return err
			}
			defer p.close()
			for i := w; i < msgs; i += directPublishers {
				if err := p.publish(subject(i%len(e.devices)), e.cfg.Payload, false); err != nil {
					return err
				}
				if i%20_000 == w {
					e.prog.show("%s, window of %d × %d: %d/%d acknowledged", name, directPublishers, directWindow, acked.Load(), msgs)
				}
			}
			err = p.wait(gctx, 60*time.Second)
			acked.Add(int64(p.sent))
			errs.Add(p.errs.Load())
			return err
		})
	}
	err = g.Wait()
	res.Errors += errs.Load()
	if err != nil {
		return res, fmt.Errorf("windowed run: %w", err)
	}
	// An error reply (no responders, a stream's refusal) answers a publish but acknowledges nothing.
	res.AckedPerSec = float64(int64(msgs)-errs.Load()) / time.Since(tstart).Seconds()
	w, err := e.waitCount(ctx, directOutgoing, uint64(msgs), tstart, "windowed run")
	if err != nil {
		return res, err
	}
	res.StoredPerSec = float64(msgs) / w.done.Sub(tstart).Seconds()
	res.ServerCPU, res.ClientCPU = cpu.stop()
	res.Messages = msgs
	return res, nil
}

// replicas are in-process kvmapper replicas sharing one path.
type replicas struct {
	cancel context.CancelFunc
	g      *errgroup.Group
}

// startReplicas starts cfg.Replicas replicas with run and returns once they serve every partition
// between them (a lease alone does not say so: a claim whose answer was lost leaves a lease its
// claimer does not hold).
func (e *env) startReplicas(ctx context.Context, n Names, run func(ctx context.Context, id string, ready func(*mapper.Replica)) error) (*replicas, error) {
	rctx, cancel := context.WithCancel(ctx)
	g, gctx := errgroup.WithContext(rctx)
	rs := &replicas{cancel: cancel, g: g}
	var mu sync.Mutex
	var reps []*mapper.Replica
	for i := range e.cfg.Replicas {
		id := fmt.Sprintf("bench-%d-%d", e.runs, i+1)
		g.Go(func() error {
			err := run(gctx, id, func(r *mapper.Replica) {
				mu.Lock()
				reps = append(reps, r)
				mu.Unlock()
			})
			if err == nil && gctx.Err() == nil {
				err = fmt.Errorf("replica %s stopped on its own", id)
			}
			return err
		})
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		mu.Lock()
		// Serving, not Owned: a lease is held before the lane has subscribed, and in direct mode
		// a core publish to a partition nobody has subscribed yet is answered "no responders".
		owned := 0
		for _, r := range reps {
			owned += r.Serving()
		}
		all := len(reps) == e.cfg.Replicas
		mu.Unlock()
		if all && owned == n.Partitions {
			return rs, nil
		}
		e.prog.show("waiting for the replicas to serve every partition: %d/%d", owned, n.Partitions)
		select {
		case <-time.After(20 * time.Millisecond):
		case <-gctx.Done():
			return nil, rs.stop()
		}
		if time.Now().After(deadline) {
			_ = rs.stop()
			return nil, fmt.Errorf("only %d of %d partitions served after 60s", owned, n.Partitions)
		}
	}
}

// stop stops the replicas and waits for them.
func (rs *replicas) stop() error {
	rs.cancel()
	return rs.g.Wait()
}

// runStreamReplica is [RunReplica], handing its replica to ready.
func runStreamReplica(ctx context.Context, log zerolog.Logger, url, id string, n Names, ready func(*mapper.Replica)) error {
	lay, err := subjects.NewLayout(inTemplate, outTemplate, unmappedTemplate, n.Partitions)
	if err != nil {
		return err
	}
	scfg := setup.Config{Layout: lay, Names: n.Names}
	return runReplica(ctx, log, url, id, mapper.Config{ID: id, Setup: scfg, Lanes: lanes.Config{Layout: lay, Incoming: n.Incoming}}, ready)
}

// runDirectReplica runs one direct-mode replica devices reach through lay's in template, with the
// provenance headers or without.
func runDirectReplica(ctx context.Context, log zerolog.Logger, url, id string, n Names, lay *subjects.Layout, r wire.Receive, provenance bool, ready func(*mapper.Replica)) error {
	scfg := setup.Config{Layout: lay, Names: n.Names, Mode: wire.ModeDirect, Receive: r}
	return runReplica(ctx, log, url, id, mapper.Config{ID: id, Setup: scfg, Lanes: lanes.Config{Layout: lay},
		Direct: direct.Config{Provenance: provenance}}, ready)
}

// runReplica runs one replica of cfg on a connection of its own, as `kvmapper run` does, and
// hands it to ready once its table is loaded.
func runReplica(ctx context.Context, log zerolog.Logger, url, id string, cfg mapper.Config, ready func(*mapper.Replica)) error {
	nc, err := nats.Connect(url, nats.Name("kvmapper bench "+id), nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	cfg.Setup.Defaults()
	cfg.Logger = log.With().Str("replica", id).Logger()
	r, err := mapper.New(ctx, js, cfg)
	if err != nil {
		return err
	}
	return r.Run(ctx, func() { ready(r) })
}

// writeText writes the direct run's tables.
func (d *DirectResult) writeText(p func(format string, a ...any)) {
	p("")
	p("DIRECT MODE: %d msgs/s for %.0fs after a %.1fs warm-up, then %d messages from %d publishers with %d PubAcks in flight each; %d kvmapper replica(s)",
		d.Rate, float64(d.Duration), float64(d.Warmup), d.Messages, d.Publishers, d.Window, d.Replicas)
	p("path\tPubAck p50\tp99\tp99.9\tdelivery p50\tp99\tp99.9\tacked msgs/s\tstored msgs/s\tCPU µs/msg\terrors")
	for _, r := range d.Paths {
		p("%s\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%.0f\t%.0f\t%.1f\t%d", r.Name, r.Ack.P50, r.Ack.P99, r.Ack.P999,
			r.Delivery.P50, r.Delivery.P99, r.Delivery.P999, r.AckedPerSec, r.StoredPerSec, r.CPUPerMsg(), r.Errors)
	}
	for name, why := range d.Skipped {
		p("%s\tnot run: %s", name, why)
	}
	for _, name := range []string{PathDirectMapped, PathDirectAll, PathDirectProvenance} {
		a, ok := d.Added[name]
		if !ok {
			continue
		}
		p("%s: PubAck latency added over straight p50 %.3f ms, p99 %.3f ms, p99.9 %.3f ms; throughput %.2f× straight",
			name, a.P50, a.P99, a.P999, d.Ratio[name])
		p("targets: added p50 ≤ 0.2 ms: %s; added p99 ≤ 1 ms: %s; ≥ 0.8× straight: %s",
			mark(a.P50 <= 0.2), mark(a.P99 <= 1), mark(d.Ratio[name] >= 0.8))
	}
}
