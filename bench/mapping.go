package bench

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// MappingResult times group changes: from a Put on the groups bucket to the first message of the
// device delivered from OUTGOING under the new group.
type MappingResult struct {
	Changes  int `json:"changes"`
	TimedOut int `json:"timed_out"`
	// Load is the background rate, in messages a second, over all devices while groups change.
	Load int `json:"load"`
	// ProbeInterval is how often the changed device publishes: it bounds the resolution.
	ProbeInterval Millis      `json:"probe_interval_ms"`
	Latency       Percentiles `json:"latency"`
}

const (
	probeDevice   = "probe"
	probeInterval = 500 * time.Microsecond
	changeTimeout = 5 * time.Second
)

// change is one group change being timed; the subscription closes seen when the group shows up.
type change struct {
	group string
	once  sync.Once
	seen  chan struct{}
	at    time.Time
}

func (e *env) mapping(ctx context.Context) (*MappingResult, error) {
	if err := e.createIncoming(ctx); err != nil {
		return nil, err
	}
	if err := e.purgeIncoming(ctx); err != nil {
		return nil, err
	}
	groups, err := e.js.KeyValue(ctx, groupsBucket)
	if err != nil {
		return nil, err
	}
	if _, err := groups.Put(ctx, probeDevice, []byte("chg-0")); err != nil {
		return nil, err
	}
	names := e.names("BENCH_OUT_MAPPING")
	if err := e.ensure(ctx, names); err != nil {
		return nil, err
	}

	var cur atomic.Pointer[change]
	first := &change{group: "chg-0", seen: make(chan struct{})}
	cur.Store(first)
	sub, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench subscriber"))
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	s, err := sub.Subscribe("outgoing.*."+probeDevice+".>", func(m *nats.Msg) {
		now := time.Now()
		c := cur.Load()
		if g, _, _ := strings.Cut(strings.TrimPrefix(m.Subject, "outgoing."), "."); g == c.group {
			c.once.Do(func() {
				c.at = now
				close(c.seen)
			})
		}
	})
	if err != nil {
		return nil, err
	}
	if err := s.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	if err := sub.Flush(); err != nil {
		return nil, err
	}

	m, err := e.startMappers(ctx, names, e.cfg.Replicas)
	if err != nil {
		return nil, err
	}
	defer func() {
		if m != nil {
			_ = m.stop()
		}
	}()
	if err := e.waitOwned(ctx, names); err != nil {
		return nil, err
	}

	lctx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	loadErr := make(chan error, 2)
	wg.Add(2)
	go func() {
		defer wg.Done()
		loadErr <- e.load(lctx, e.cfg.ChangeLoad)
	}()
	go func() {
		defer wg.Done()
		loadErr <- e.probe(lctx)
	}()
	stop := func() error {
		stopLoad()
		wg.Wait()
		for range 2 {
			if err := <-loadErr; err != nil {
				return err
			}
		}
		return nil
	}

	res := &MappingResult{Changes: e.cfg.Changes, Load: e.cfg.ChangeLoad, ProbeInterval: millis(probeInterval)}
	var lat []time.Duration
	err = func() error {
		if err := waitSeen(ctx, first, 30*time.Second); err != nil {
			return fmt.Errorf("the probe device's first message: %w", err)
		}
		for i := 1; i <= e.cfg.Changes; i++ {
			c := &change{group: fmt.Sprintf("chg-%d", i), seen: make(chan struct{})}
			cur.Store(c)
			t0 := time.Now()
			if _, err := groups.Put(ctx, probeDevice, []byte(c.group)); err != nil {
				return err
			}
			switch err := waitSeen(ctx, c, changeTimeout); {
			case err == errTimeout:
				res.TimedOut++
			case err != nil:
				return err
			default:
				lat = append(lat, c.at.Sub(t0))
			}
			e.prog.show("mapping change: %d/%d", i, e.cfg.Changes)
		}
		return nil
	}()
	if serr := stop(); err == nil {
		err = serr
	}
	if err != nil {
		return nil, err
	}
	res.Latency = percentiles(lat)
	err = m.stop()
	m = nil
	if err != nil {
		return nil, err
	}
	return res, e.dropRun(ctx, names)
}

var errTimeout = fmt.Errorf("not seen within %v", changeTimeout)

func waitSeen(ctx context.Context, c *change, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-c.seen:
		return nil
	case <-t.C:
		return errTimeout
	case <-ctx.Done():
		return ctx.Err()
	}
}

// load publishes into INCOMING at rate messages a second over all devices until ctx is done.
func (e *env) load(ctx context.Context, rate int) error {
	_, err := e.publishAt(ctx, rate, func(i int) string { return "incoming." + e.devices[i%len(e.devices)] + "." + event })
	return err
}

// probe publishes the probe device's messages every probeInterval until ctx is done.
func (e *env) probe(ctx context.Context) error {
	_, err := e.publishAt(ctx, int(time.Second/probeInterval), func(int) string { return "incoming." + probeDevice + "." + event })
	return err
}

// publishAt publishes into subject(i) at rate messages a second on a connection of its own until
// ctx is done, and returns how many it published (all acknowledged when err is nil).
func (e *env) publishAt(ctx context.Context, rate int, subject func(i int) string) (int, error) {
	nc, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench load"))
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(publishWindow))
	if err != nil {
		return 0, err
	}
	interval := time.Second / time.Duration(rate)
	start := time.Now()
	data := make([]byte, e.cfg.Payload)
	n := 0
	for i := 0; ; i++ {
		if d := time.Until(start.Add(time.Duration(i) * interval)); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
			}
		}
		if ctx.Err() != nil {
			break
		}
		if _, err := js.PublishAsync(subject(i), e.payload(data, time.Now()), stall...); err != nil {
			return n, err
		}
		n++
	}
	select {
	case <-js.PublishAsyncComplete():
		return n, nil
	case <-time.After(30 * time.Second):
		return n, fmt.Errorf("publishes not acknowledged within 30s")
	}
}
