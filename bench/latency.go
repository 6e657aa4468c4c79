package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Percentiles summarise a set of latencies, in milliseconds.
type Percentiles struct {
	Samples int    `json:"samples"`
	P50     Millis `json:"p50_ms"`
	P90     Millis `json:"p90_ms"`
	P99     Millis `json:"p99_ms"`
	P999    Millis `json:"p99_9_ms"`
	Max     Millis `json:"max_ms"`
}

func percentiles(d []time.Duration) Percentiles {
	if len(d) == 0 {
		return Percentiles{}
	}
	slices.Sort(d)
	at := func(q float64) Millis {
		i := int(q * float64(len(d)))
		return millis(d[min(i, len(d)-1)])
	}
	return Percentiles{Samples: len(d), P50: at(0.50), P90: at(0.90), P99: at(0.99), P999: at(0.999), Max: millis(d[len(d)-1])}
}

// minus returns p − q, percentile by percentile: the latency q's path adds to p's.
func (p Percentiles) minus(q Percentiles) Percentiles {
	return Percentiles{Samples: p.Samples, P50: p.P50 - q.P50, P90: p.P90 - q.P90, P99: p.P99 - q.P99, P999: p.P999 - q.P999, Max: p.Max - q.Max}
}

// LatencyRun is one fixed-rate run: device publish to delivery from OUTGOING.
type LatencyRun struct {
	Sent     int         `json:"sent"`
	Received int         `json:"received"`
	Latency  Percentiles `json:"latency"`
	// Rate is the publish rate achieved over the measured part of the run.
	Rate float64 `json:"rate"`
}

// LatencyResult compares kvmapper's end-to-end latency with publishing straight into OUTGOING.
type LatencyResult struct {
	Rate     int     `json:"rate"`
	Duration Seconds `json:"duration_s"`
	Warmup   Seconds `json:"warmup_s"`
	// Direct: publishing straight into OUTGOING, received by a core subscription on outgoing.>.
	Direct LatencyRun `json:"direct"`
	// Relay: publishing into INCOMING, through a relay that maps as a user would and keeps none
	// of kvmapper's bookkeeping ([RelayAsync]), received the same way: what one consume-and-
	// republish hop costs on this machine, whoever makes it.
	Relay LatencyRun `json:"relay"`
	// KVMapper: publishing into INCOMING, through kvmapper, received the same way.
	KVMapper LatencyRun `json:"kvmapper"`
	// Added is KVMapper's latency minus Direct's, percentile by percentile.
	Added Percentiles `json:"added"`
	// RelayAdded is Relay's latency minus Direct's: the floor under Added.
	RelayAdded Percentiles `json:"relay_added"`
}

func (e *env) latency(ctx context.Context) (*LatencyResult, error) {
	if err := e.createIncoming(ctx); err != nil {
		return nil, err
	}
	if err := e.purgeIncoming(ctx); err != nil {
		return nil, err
	}
	names := e.names("BENCH_OUT_LATENCY")
	if err := e.ensure(ctx, names); err != nil {
		return nil, err
	}
	res := &LatencyResult{Rate: e.cfg.Rate, Duration: secs(e.cfg.Duration), Warmup: secs(e.warmup())}
	var err error
	res.Direct, err = e.measure(ctx, "latency, straight into OUTGOING", e.outSubject)
	if err != nil {
		return nil, err
	}
	incoming := func(i int) string { return "incoming." + e.devices[i] + "." + event }
	if err := e.purgeOutgoing(ctx, names); err != nil {
		return nil, err
	}
	if res.Relay, err = e.measureRelay(ctx, incoming); err != nil {
		return nil, err
	}
	// kvmapper starts from the beginning of INCOMING, after what the relay read.
	if err := e.purgeIncoming(ctx); err != nil {
		return nil, err
	}
	if err := e.purgeOutgoing(ctx, names); err != nil {
		return nil, err
	}
	m, err := e.startMappers(ctx, names, e.cfg.Replicas)
	if err != nil {
		return nil, err
	}
	if err := e.waitOwned(ctx, names); err != nil {
		_ = m.stop()
		return nil, err
	}
	res.KVMapper, err = e.measure(ctx, "latency, through kvmapper", incoming)
	if serr := m.stop(); err == nil {
		err = serr
	}
	if err != nil {
		return nil, err
	}
	res.Added = res.KVMapper.Latency.minus(res.Direct.Latency)
	res.RelayAdded = res.Relay.Latency.minus(res.Direct.Latency)
	return res, e.dropRun(ctx, names)
}

// purgeOutgoing empties the run's OUTGOING between two paths.
func (e *env) purgeOutgoing(ctx context.Context, names Names) error {
	s, err := e.js.Stream(ctx, names.Outgoing)
	if err != nil {
		return err
	}
	return s.Purge(ctx)
}

// measureRelay times the path through a [RelayAsync] relay into the run's OUTGOING.
func (e *env) measureRelay(ctx context.Context, subject func(i int) string) (LatencyRun, error) {
	nc, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench relay"))
	if err != nil {
		return LatencyRun{}, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(relayWindow))
	if err != nil {
		return LatencyRun{}, err
	}
	rctx, stop := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() {
		errc <- e.relay(rctx, js, asyncWrite(js))
	}()
	run, err := e.measure(ctx, "latency, through a relay", subject)
	stop()
	if rerr := <-errc; err == nil && rerr != nil && !errors.Is(rerr, context.Canceled) {
		err = fmt.Errorf("latency, through a relay: %w", rerr)
	}
	return run, err
}

// warmup is the first part of a latency run, whose samples are left out: consumers start, caches
// fill. A tenth of the run, at most a second.
func (e *env) warmup() time.Duration { return min(e.cfg.Duration/10, time.Second) }

// measure publishes at the configured rate to subject(device) for the configured time plus the
// warm-up, and times each message from its publish to its delivery on outgoing.>.
func (e *env) measure(ctx context.Context, what string, subject func(i int) string) (LatencyRun, error) {
	var run LatencyRun
	sub, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench subscriber"))
	if err != nil {
		return run, err
	}
	defer sub.Close()
	var mu sync.Mutex
	lat := make([]time.Duration, 0, int(float64(e.cfg.Rate)*e.cfg.Duration.Seconds())+16)
	received := 0
	s, err := sub.Subscribe("outgoing.>", func(m *nats.Msg) {
		now := time.Now()
		t, ok := stamp(m.Data)
		mu.Lock()
		received++
		if ok && m.Data[8] == 1 {
			lat = append(lat, now.Sub(t))
		}
		mu.Unlock()
	})
	if err != nil {
		return run, err
	}
	if err := s.SetPendingLimits(-1, -1); err != nil {
		return run, err
	}
	if err := sub.Flush(); err != nil {
		return run, err
	}

	pub, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench publisher"))
	if err != nil {
		return run, err
	}
	defer pub.Close()
	js, err := jetstream.New(pub, jetstream.WithPublishAsyncMaxPending(publishWindow))
	if err != nil {
		return run, err
	}
	warm := e.warmup()
	total := e.cfg.Duration + warm
	interval := time.Second / time.Duration(e.cfg.Rate)
	start := time.Now()
	measured := start.Add(warm)
	end := start.Add(total)
	sent, measuredSent := 0, 0
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
				return run, ctx.Err()
			}
		}
		now := time.Now()
		data := make([]byte, e.cfg.Payload)
		binary.LittleEndian.PutUint64(data, uint64(now.UnixNano()))
		if !now.Before(measured) {
			data[8] = 1
			measuredSent++
		}
		if _, err := js.PublishMsgAsync(&nats.Msg{Subject: subject(i % len(e.devices)), Data: data}, stall...); err != nil {
			return run, fmt.Errorf("%s: publishing: %w", what, err)
		}
		sent++
		if i%1000 == 0 {
			e.prog.show("%s: %.0f of %.0f s", what, now.Sub(start).Seconds(), total.Seconds())
		}
	}
	run.Rate = float64(measuredSent) / time.Since(measured).Seconds()
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(30 * time.Second):
		return run, fmt.Errorf("%s: publishes not acknowledged within 30s", what)
	case <-ctx.Done():
		return run, ctx.Err()
	}
	// Wait for the tail to be delivered.
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		got := received
		mu.Unlock()
		if got >= sent || time.Now().After(deadline) {
			break
		}
		e.prog.show("%s: waiting for %d messages", what, sent-got)
		t := time.NewTimer(10 * time.Millisecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return run, ctx.Err()
		}
	}
	if err := s.Unsubscribe(); err != nil {
		return run, err
	}
	mu.Lock()
	defer mu.Unlock()
	run.Sent, run.Received = sent, received
	run.Latency = percentiles(lat)
	if received < sent {
		return run, fmt.Errorf("%s: %d of %d messages delivered within 10s of the last publish", what, received, sent)
	}
	return run, nil
}
