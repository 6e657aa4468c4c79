package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// newDirectEnv is a server set up for direct mode with receive mode r: with the account mapping
// the mapping receive mode needs (as `kvmapper run --embedded --mode direct` gives its own
// server), without it for the all receive mode.
func newDirectEnv(t *testing.T, r wire.Receive) *env {
	t.Helper()
	srv := natstest.Start(t)
	lay := layout(t)
	if r == wire.ReceiveMapping {
		if err := srv.GlobalAccount().AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
			t.Fatal(err)
		}
	}
	e := &env{t: t, srv: srv, names: subjects.Names{}.WithDefaults()}
	e.nc, e.js = srv.JetStream(t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := setup.Ensure(ctx, e.js, setup.Config{Layout: lay, Mode: wire.ModeDirect, Receive: r}); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	var err error
	if e.groups, err = e.js.KeyValue(ctx, "device-groups"); err != nil {
		t.Fatal(err)
	}
	if e.ctl, err = e.js.KeyValue(ctx, "kvmapper"); err != nil {
		t.Fatal(err)
	}
	return e
}

// eachReceive runs test once per direct receive mode, each on a server of its own.
func eachReceive(t *testing.T, test func(t *testing.T, e *env, r wire.Receive)) {
	t.Helper()
	for _, r := range []wire.Receive{wire.ReceiveMapping, wire.ReceiveAll} {
		t.Run(string(r), func(t *testing.T) { test(t, newDirectEnv(t, r), r) })
	}
}

// startDirect starts `kvmapper run --mode direct` against the env's server and waits until it maps.
func (e *env) startDirect(id string, r wire.Receive, extra ...string) *mapper {
	e.t.Helper()
	args := []string{"run", "--server", e.srv.URL(), "--mode", "direct", "--direct-receive", string(r),
		"--replica-id", id, "--log-format", "json", "--log-level", "debug"}
	args = append(append(args, fastFlags...), extra...)
	m := startProcess(e.t, id, args...)
	m.waitLog("groups table loaded", 30*time.Second)
	return m
}

// waitServed waits until the replicas named serve every partition between them, each once, as
// their status endpoints report. A lease alone does not say it: a lease names its owner before
// the owner serves the partition, and a claim whose answer was lost names its claimer until the
// claimer reads it back and takes it.
func (e *env) waitServed(ids ...string) {
	e.t.Helper()
	natstest.Eventually(e.t, 30*time.Second, func() error {
		served := map[int]string{}
		for _, id := range ids {
			resp, err := e.nc.Request(status.StatusSubject("kvmapper", id), nil, time.Second)
			if err != nil {
				return fmt.Errorf("status of %s: %w", id, err)
			}
			var r status.Report
			if err := json.Unmarshal(resp.Data, &r); err != nil {
				return err
			}
			for _, p := range r.Partitions {
				if other, ok := served[p.Partition]; ok {
					return fmt.Errorf("partition %d served by %s and %s", p.Partition, other, id)
				}
				served[p.Partition] = id
			}
		}
		if len(served) != partitions {
			return fmt.Errorf("%d of %d partitions served by %v", len(served), partitions, ids)
		}
		return nil
	})
}

// devices publish as devices do in direct mode: with js.Publish, each waiting for its
// acknowledgement before its next message. Payloads are "<device>:<n>". With retry, a device
// resends a message that got no acknowledgement (an error, or none within half a second) with
// the same Nats-Msg-Id until it gets one; without, every message that gets none is an error.
type devices struct {
	t     *testing.T
	retry bool
	wg    sync.WaitGroup
	stop  chan struct{}
	acked atomic.Int64
	mu    sync.Mutex
	n     map[string]int
	gap   map[string]time.Duration // the longest a device waited between two acknowledgements
	from  map[string]time.Time     // when that wait began
	errs  []error
	// ids says which devices set a Nats-Msg-Id (all of them with retry).
	ids func(i int) bool
	// ackedAt holds, by device, when its last acknowledgement came (Unix nanoseconds).
	ackedAt map[string]*atomic.Int64
}

func (e *env) startDevices(devs []string, retry bool) *devices {
	d := &devices{t: e.t, retry: retry, stop: make(chan struct{}), n: map[string]int{}, gap: map[string]time.Duration{}, from: map[string]time.Time{},
		ids: func(i int) bool { return retry || i%2 == 0 }, ackedAt: map[string]*atomic.Int64{}}
	for _, dev := range devs {
		d.ackedAt[dev] = &atomic.Int64{}
	}
	for i, dev := range devs {
		_, js := e.srv.JetStream(e.t, nats.MaxReconnects(-1))
		withID := d.ids(i)
		d.wg.Go(func() { d.publish(js, dev, withID) })
	}
	return d
}

func (d *devices) publish(js jetstream.JetStream, dev string, withID bool) {
	last := time.Now()
	var gap time.Duration
	var from time.Time
	defer func() {
		d.mu.Lock()
		d.gap[dev], d.from[dev] = gap, from
		d.mu.Unlock()
	}()
	for n := 0; ; n++ {
		select {
		case <-d.stop:
			d.mu.Lock()
			d.n[dev] = n
			d.mu.Unlock()
			return
		default:
		}
		opts := []jetstream.PublishOpt{jetstream.WithRetryAttempts(0)}
		if withID {
			opts = append(opts, jetstream.WithMsgID(dev+":"+strconv.Itoa(n)))
		}
		for {
			// A device that retries gives up on an acknowledgement after half a second; one that
			// does not waits long enough that only a lost message runs out of time.
			timeout := 5 * time.Second
			if d.retry {
				timeout = 500 * time.Millisecond
			}
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			ack, err := js.Publish(ctx, "incoming."+dev+".evt", []byte(dev+":"+strconv.Itoa(n)), opts...)
			cancel()
			if err == nil && ack.Stream != "OUTGOING" {
				err = fmt.Errorf("acknowledged by %s", ack.Stream)
			}
			if err == nil {
				now := time.Now()
				if now.Sub(last) > gap {
					gap, from = now.Sub(last), last
				}
				last = now
				d.ackedAt[dev].Store(now.UnixNano())
				d.acked.Add(1)
				break
			}
			if !d.retry {
				d.mu.Lock()
				d.errs = append(d.errs, fmt.Errorf("%s message %d: %w", dev, n, err))
				d.mu.Unlock()
				d.acked.Add(1) // counted, to keep the test moving
				break
			}
			if errors.Is(err, jetstream.ErrNoStreamResponse) {
				// No owner subscribed (mapping): nobody to wait for; try again shortly.
				select {
				case <-time.After(20 * time.Millisecond):
				case <-d.stop:
				}
			}
		}
	}
}

// waitAcked waits until the devices have n more acknowledgements.
func (d *devices) waitAcked(n int64) {
	d.t.Helper()
	want := d.acked.Load() + n
	natstest.Eventually(d.t, 30*time.Second, func() error {
		if got := d.acked.Load(); got < want {
			return fmt.Errorf("devices have %d acknowledgements, want %d", got, want)
		}
		return nil
	})
}

// longest describes the longest wait of any device between two acknowledgements, for a log: the
// device, its partition and when the wait began. Call it after halt.
func (d *devices) longest() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var dev string
	for k, g := range d.gap {
		if dev == "" || g > d.gap[dev] {
			dev = k
		}
	}
	if dev == "" {
		return "no device"
	}
	return fmt.Sprintf("%v by %s (partition %d) from %s", d.gap[dev].Round(time.Millisecond), dev,
		subjects.Partition(dev, partitions), d.from[dev].UTC().Format("15:04:05.000"))
}

// waitEachAcked waits until every device has had an acknowledgement after t.
func (d *devices) waitEachAcked(t time.Time) {
	d.t.Helper()
	natstest.Eventually(d.t, 30*time.Second, func() error {
		for dev, at := range d.ackedAt {
			if at.Load() <= t.UnixNano() {
				return fmt.Errorf("%s has had no acknowledgement since %s", dev, t.UTC().Format("15:04:05.000"))
			}
		}
		return nil
	})
}

// halt stops the devices, fails the test for every message without a PubAck, and returns how
// many messages each device sent and its longest wait between two acknowledgements.
func (d *devices) halt() (map[string]int, map[string]time.Duration) {
	close(d.stop)
	d.wg.Wait()
	d.mu.Lock()
	defer d.mu.Unlock()
	for i, err := range d.errs {
		if i == 5 {
			d.t.Errorf("… and %d more", len(d.errs)-5)
			break
		}
		d.t.Errorf("no PubAck: %v", err)
	}
	return d.n, d.gap
}

// TestDirectKillNineTakeover kills owners with SIGKILL under load, in both receive modes. The
// devices resend what gets no acknowledgement with the same Nats-Msg-Id: nothing is lost, nothing
// is stored twice, every device's order holds, and no device waits for an acknowledgement much
// longer than the takeover (lease TTL 1s, then the claim).
func TestDirectKillNineTakeover(t *testing.T) {
	eachReceive(t, func(t *testing.T, e *env, r wire.Receive) {
		devs := e.mappedDevices(32)
		lw := e.watchLeases()
		ids := []string{"r0", "r1", "r2"}
		reps := map[string]*mapper{}
		for _, id := range ids {
			reps[id] = e.startDirect(id, r)
		}
		lw.waitBalanced(t, ids...)
		d := e.startDevices(devs, true)
		d.waitAcked(500)
		for _, victim := range []string{"r1", "r2"} {
			// Killed as soon as the leases are balanced: the kill may strike handoffs of the
			// rebalance still under way, as the victim hands partitions to the replica restarted
			// before it.
			lw.waitBalanced(t, ids...)
			reps[victim].kill()
			lw.waitBalanced(t, slices.DeleteFunc(slices.Clone(ids), func(s string) bool { return s == victim })...)
			// Every device served again before the next kill: each wait measured is one
			// takeover, not a device caught by two (its partition's new owner killed next).
			// From the survivors' claims on: a PubAck for what the victim forwarded just before
			// it died can come after the kill.
			d.waitEachAcked(time.Now())
			reps[victim] = e.startDirect(victim, r)
		}
		lw.waitBalanced(t, ids...)
		d.waitEachAcked(time.Now())
		sent, gaps := d.halt()
		var worst time.Duration
		for _, g := range gaps {
			worst = max(worst, g)
		}
		total := 0
		for _, n := range sent {
			total += n
		}
		perDevice(t, e.readStream("OUTGOING", total, 30*time.Second), sent)
		t.Logf("2 kill -9, %d messages: the longest a device waited for an acknowledgement was %s (lease TTL 1s)", total, d.longest())
		// Behaviour, with a wide margin for a loaded machine: the wait is the takeover, lease
		// expiry then the claim; the new owner serves as soon as it finds nobody to take over from.
		if worst > 3*time.Second {
			t.Errorf("a device waited %v for an acknowledgement, want well under lease TTL (1s) + 2s", worst)
		}
	})
}

// TestDirectGracefulHandoffsLoseNoAcknowledgement moves partitions between replica processes
// gracefully under load, in both receive modes: replicas joining (each rebalance hands
// partitions over), SIGTERM of one and its restart. The devices never retry, and half of them set
// no Nats-Msg-Id (OUTGOING could not drop a second copy): every message gets its PubAck from
// OUTGOING and is stored once, in order.
func TestDirectGracefulHandoffsLoseNoAcknowledgement(t *testing.T) {
	eachReceive(t, func(t *testing.T, e *env, r wire.Receive) {
		devs := e.mappedDevices(32)
		lw := e.watchLeases()
		reps := map[string]*mapper{"r0": e.startDirect("r0", r)}
		lw.waitBalanced(t, "r0")
		e.waitServed("r0")
		d := e.startDevices(devs, false)
		d.waitAcked(300)
		reps["r1"] = e.startDirect("r1", r) // r0 hands half its partitions to r1
		lw.waitBalanced(t, "r0", "r1")
		d.waitAcked(300)
		reps["r2"] = e.startDirect("r2", r)
		lw.waitBalanced(t, "r0", "r1", "r2")
		d.waitAcked(300)
		reps["r0"].stop() // SIGTERM: r1 and r2 take its partitions over
		lw.waitBalanced(t, "r1", "r2")
		d.waitAcked(300)
		reps["r0"] = e.startDirect("r0", r)
		lw.waitBalanced(t, "r0", "r1", "r2")
		d.waitAcked(300)
		sent, gaps := d.halt()
		total := 0
		var worst time.Duration
		for dev, n := range sent {
			total += n
			worst = max(worst, gaps[dev])
		}
		perDevice(t, e.readStream("OUTGOING", total, 30*time.Second), sent)
		t.Logf("%d messages through 4 rebalances and a SIGTERM, every one acknowledged by OUTGOING; the longest a device waited for one was %v",
			total, worst.Round(time.Millisecond))
	})
}
