package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	replica "github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// clusterEnv is kvmapper as docs/cluster.md's recipe runs it: a 3-node JetStream cluster
// (in process, routes on loopback; natstest.Cluster's Kill is a crash), every stream and bucket
// at 3 replicas, and three replicas wired as `kvmapper run` wires them (mapper.Replica) with its
// default settings, replica i connected to node i first and failing over to the others.
type clusterEnv struct {
	t     *testing.T
	c     *natstest.Cluster
	lay   *subjects.Layout
	names subjects.Names
	scfg  setup.Config
	admin jetstream.JetStream
	reps  []*replica.Replica
	logs  []*logBuf // each replica's log, JSON lines at info level and above
	stops []func()
	// strays are devices of the load without a group: their messages go to UNMAPPED.
	strays []string
	// gen is the load's generator (newGenerator), whose acknowledgements tell when INCOMING
	// had each message for good.
	gen *generator
}

// runDefaults are the lane and election settings `kvmapper run` passes when no flag is given;
// the lease TTL is left to the replica, which chooses it from the control bucket.
func runDefaults(lay *subjects.Layout) (lanes.Config, election.Config) {
	return lanes.Config{Layout: lay, MaxInFlight: 4096, MaxInFlightBytes: 64 << 20, CheckpointInterval: 100 * time.Millisecond,
			PublishTimeout: 5 * time.Second, DrainTimeout: 10 * time.Second},
		election.Config{RenewInterval: 500 * time.Millisecond, Grace: 2 * time.Second}
}

func newClusterEnv(t *testing.T, sl subjects.StreamLayout, devices []string) *clusterEnv {
	t.Helper()
	lay := layout(t)
	var mods []func(*server.Options)
	if sl == subjects.PartitionStreams {
		// Each server gets the account mapping, as its configuration file would give it.
		mods = append(mods, func(o *server.Options) {
			acc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
			if err := acc.AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
				t.Fatal(err)
			}
			o.Accounts = []*server.Account{acc}
		})
	}
	e := &clusterEnv{t: t, c: natstest.StartCluster(t, 3, mods...), lay: lay, names: subjects.Names{StreamLayout: sl}.WithDefaults()}
	e.scfg = setup.Config{Layout: lay, Names: e.names, Replicas: 3}
	e.scfg.Defaults()
	var err error
	if e.admin, err = jetstream.New(e.c.Connect(t, 0, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := setup.Ensure(ctx, e.admin, e.scfg); err != nil {
		t.Fatalf("setup.Ensure(3 replicas): %v", err)
	}
	groups, err := e.admin.KeyValue(ctx, e.names.Groups)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range devices {
		if _, err := groups.PutString(ctx, d, "g"); err != nil {
			t.Fatal(err)
		}
	}
	for i := range e.c.Size() {
		e.startReplica(i)
	}
	// Until each replica owns its quota: the first to start claims more and hands the surplus
	// back a moment later, which a test that takes the owners before a fault would count as
	// moved by it. Up to 2 minutes: a partition claimed past the quota after a lane's failure
	// is kept for 5 lease TTLs (election's graceHold) before it is handed back (a clean-clone CI run on 2026-12-07: one partition handed back during
	// TestClusterIncomingStepDown's step-downs).
	var ids []string
	for i := range e.reps {
		ids = append(ids, "r"+strconv.Itoa(i))
	}
	natstest.Eventually(t, 2*time.Minute, func() error {
		for i, r := range e.reps {
			if n, q := len(r.Owned()), election.Quota(partitions, ids, ids[i]); n != q {
				return fmt.Errorf("%s owns %d partitions, want its quota, %d", ids[i], n, q)
			}
		}
		return nil
	})
	return e
}

// startReplica runs replica r<i> on a connection to node i first, until the end of the test.
func (e *clusterEnv) startReplica(i int) {
	t := e.t
	nc := e.c.Connect(t, i, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// The control plane on a connection of its own, as `kvmapper run` dials it.
	control, err := jetstream.New(e.c.Connect(t, i, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1)))
	if err != nil {
		t.Fatal(err)
	}
	lcfg, ecfg := runDefaults(e.lay)
	id := "r" + strconv.Itoa(i)
	logs := &logBuf{}
	// Info and above, and the election's debug lines (renewals), which tell a lost lease's story.
	log := zerolog.New(electionDebug{logs}).Level(zerolog.DebugLevel).With().Timestamp().Str("replica", id).Logger()
	r, err := replica.New(context.Background(), js, replica.Config{ID: id, Setup: e.scfg, Lanes: lcfg, Election: ecfg, Logger: log, Control: control})
	if err != nil {
		t.Fatalf("replica.New(%s): %v", id, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() { done <- r.Run(ctx, func() { close(ready) }) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("%s: Run() = %v, want nil", id, err)
				}
				abandoned(t, id, logs)
			case <-time.After(60 * time.Second):
				t.Errorf("%s: Run did not return within 60s of cancel", id)
			}
		})
	}
	t.Cleanup(stop)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("warnings, errors and consumer resets of %s:\n%s", id, logs.matching(`"level":"(warn|error)"|"consumer reset"`, 80))
		}
		if dir := os.Getenv("KVMAPPER_TEST_LOGDIR"); dir != "" {
			_ = os.WriteFile(filepath.Join(dir, strings.ReplaceAll(t.Name(), "/", "_")+"-"+id+".log"), []byte(logs.String()), 0o644)
		}
	})
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("%s: Run() = %v before its groups table was loaded", id, err)
	case <-time.After(60 * time.Second):
		t.Fatalf("%s: groups table not loaded within 60s", id)
	}
	e.reps, e.stops, e.logs = append(e.reps, r), append(e.stops, stop), append(e.logs, logs)
}

// leases returns every partition's owner and epoch, read from the control bucket's leader: a
// partition whose owner stayed and was never claimed again has the same both.
func (e *clusterEnv) leases() []string {
	e.t.Helper()
	out := make([]string, partitions)
	// The leader answers such reads after an election, though not always at once on a loaded
	// machine: each read gets 10s, all of them 90s.
	natstest.Eventually(e.t, 90*time.Second, func() error {
		for p := range partitions {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m, err := kvcas.Latest(ctx, e.admin, e.names.Control, wire.LeaseKey(p))
			if err != nil {
				return fmt.Errorf("reading lease %d: %w", p, err)
			}
			if kvcas.Deleted(m) {
				return fmt.Errorf("partition %d has no owner", p)
			}
			// A claim has no epoch header (its revision is the epoch); every renewal names it.
			epoch := m.Header.Get("Kvmapper-Lease-Epoch")
			if epoch == "" {
				epoch = strconv.FormatUint(m.Sequence, 10)
			}
			out[p] = string(m.Data) + "@" + epoch
		}
		return nil
	})
	return out
}

// sameOwners fails the test when a partition changed owner, or was claimed again, since before.
func (e *clusterEnv) sameOwners(fault string, before []string) {
	e.t.Helper()
	if moved := e.moved(before); len(moved) > 0 {
		e.timely("%s: %d partitions changed owner or were claimed again (owner@epoch): %s", fault, len(moved), strings.Join(moved, "; "))
	}
}

// timely fails the test on a missed bound of time: a pause, a wait, a partition that changed
// owner because its lease ran out during an election, leaders not spread within setup's timeout.
// Under the race detector it only logs it. Three race-built servers and three replicas in one
// process on two cores elect a stream's leader in up to 20 s (2026-12-07: 19.6 s for a partition
// stream; without -race 4-9 s), past the leases' 15 s clock, so every bound of time is the race
// detector's, not kvmapper's. What the race step is there for stays asserted: every message of
// every device checked by e.check, none lost, duplicated or reordered, and no data race.
func (e *clusterEnv) timely(format string, args ...any) {
	e.t.Helper()
	if raceEnabled {
		e.t.Logf("not asserted under -race: "+format, args...)
		return
	}
	e.t.Errorf(format, args...)
}

// slowElection is an election of the control bucket longer than nats-server's timers make
// likely (a follower campaigns after hearing nothing for 4–9s): past it the leases' clock may run
// out (15s TTL, less its 1s margin, from a renewal up to 3.75s before the kill).
const slowElection = 10 * time.Second

// stableOwners waits for the partitions to settle after they were claimed again (the replicas
// hand back what is over their quota) and returns their leases once two reads, ten seconds of
// load apart (2.7 renew intervals), agree.
func (e *clusterEnv) stableOwners() []string {
	e.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		before := e.leases()
		e.flows(10 * faultRate)
		after := e.leases()
		if slices.Equal(before, after) {
			return after
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("partitions still changing owner 2 minutes after they were claimed again: %v → %v", before, after)
		}
	}
}

// moved lists the partitions whose lease is not the one before names (owner@epoch).
func (e *clusterEnv) moved(before []string) []string {
	e.t.Helper()
	after := e.leases()
	var moved []string
	for p := range partitions {
		if after[p] != before[p] {
			moved = append(moved, fmt.Sprintf("%d: %s → %s", p, before[p], after[p]))
		}
	}
	return moved
}

// leader returns the node leading stream, waiting for one.
func (e *clusterEnv) leader(stream string) int {
	e.t.Helper()
	return e.c.WaitStreamLeader(stream, -1, 60*time.Second)
}

// streams are every stream kvmapper uses here.
func (e *clusterEnv) streams() []string { return status.StreamNames(e.names, partitions) }

// restart starts node i again after it missed writes, and waits until every stream is led and
// every replica of it current again.
func (e *clusterEnv) restart(i int) {
	e.t.Helper()
	e.c.Restart(i)
	for _, s := range e.streams() {
		e.c.WaitStreamCurrent(s, 60*time.Second)
	}
}

// killAndElect kills node i and returns when that was and when stream's new leader was seen
// (polled every 10ms). It logs what else the node led, and how long each of those took to get
// a new leader.
func (e *clusterEnv) killAndElect(i int, stream string) (killed, elected time.Time) {
	e.t.Helper()
	var led []string
	for _, s := range e.streams() {
		if e.c.StreamLeader(s) == i {
			led = append(led, s)
		}
	}
	killed = time.Now()
	e.c.Kill(i)
	deadline := time.Now().Add(60 * time.Second)
	took := map[string]time.Duration{}
	for len(took) < len(led) {
		for _, s := range led {
			if _, ok := took[s]; !ok {
				if l := e.c.StreamLeader(s); l >= 0 && l != i {
					took[s] = time.Since(killed)
				}
			}
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("streams %v without a new leader 60s after killing node %d (elected: %v)", led, i, took)
		}
		tick := time.NewTimer(10 * time.Millisecond)
		<-tick.C
	}
	var report []string
	for _, s := range led {
		report = append(report, fmt.Sprintf("%s %v", s, took[s].Round(10*time.Millisecond)))
	}
	e.t.Logf("killed %s, the server of r%d; new leaders after: %s", e.c.Name(i), i, strings.Join(report, ", "))
	return killed, killed.Add(took[stream])
}

// generator publishes numbered messages for devices at a rate it can be told, like devices that
// keep publishing through a fault: each publish is retried until INCOMING takes it, under a
// Nats-Msg-Id of its own so that a retry of one already stored is dropped. Retries can change
// the order in which a device's messages enter INCOMING: the check compares OUTGOING with
// INCOMING, whatever the order there.
type generator struct {
	t       *testing.T
	js      jetstream.JetStream
	devices []string
	rate    atomic.Int64 // messages a second
	sent    atomic.Int64 // published and acknowledged
	stop    chan struct{}
	done    chan struct{}
	next    int

	mu sync.Mutex
	// acked is when the generator saw each payload's acknowledgement (to 10 ms, its tick):
	// INCOMING had stored it for good by then, and may not have before. A message INCOMING
	// timestamps as its leader proposes it is stored only once a quorum has it: through a
	// leader change of its stream, that can be seconds later, and what kvmapper could not
	// read yet is not kvmapper's wait.
	acked map[string]time.Time
}

type genPub struct {
	msg *nats.Msg
	fut jetstream.PubAckFuture // nil: to send
}

func startGenerator(t *testing.T, js jetstream.JetStream, devices []string, rate int) *generator {
	g := &generator{t: t, js: js, devices: devices, stop: make(chan struct{}), done: make(chan struct{}), acked: map[string]time.Time{}}
	g.rate.Store(int64(rate))
	go g.run()
	t.Cleanup(func() { g.finish(0) })
	return g
}

func (g *generator) run() {
	defer close(g.done)
	const tick = 10 * time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	var inFlight []*genPub
	counts := map[string]int{}
	stopping := false
	owed := 0.0
	for {
		select {
		case <-t.C:
		case <-g.stop:
			stopping = true
			g.stop = nil
			continue
		}
		// Settle what was answered, and queue the failures again, oldest first.
		kept := inFlight[:0]
		for _, p := range inFlight {
			if p.fut == nil {
				kept = append(kept, p)
				continue
			}
			select {
			case <-p.fut.Ok():
				g.sent.Add(1)
				g.mu.Lock()
				g.acked[string(p.msg.Data)] = time.Now()
				g.mu.Unlock()
				continue
			case <-p.fut.Err():
				p.fut = nil
			default:
			}
			kept = append(kept, p)
		}
		inFlight = kept
		if stopping && len(inFlight) == 0 {
			return
		}
		if !stopping {
			owed += float64(g.rate.Load()) * tick.Seconds()
			for ; owed >= 1; owed-- {
				d := g.devices[g.next%len(g.devices)]
				g.next++
				payload := d + ":" + strconv.Itoa(counts[d])
				counts[d]++
				m := &nats.Msg{Subject: "incoming." + d + ".evt", Data: []byte(payload), Header: nats.Header{nats.MsgIdHdr: []string{payload}}}
				inFlight = append(inFlight, &genPub{msg: m})
			}
		}
		for _, p := range inFlight {
			if p.fut != nil {
				continue
			}
			fut, err := g.js.PublishMsgAsync(p.msg, jetstream.WithStallWait(time.Millisecond))
			if err != nil {
				break // too many in flight, or disconnected: next tick
			}
			p.fut = fut
		}
	}
}

// ackedAt returns when the generator saw payload acknowledged; false if it did not.
func (g *generator) ackedAt(payload string) (time.Time, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	t, ok := g.acked[payload]
	return t, ok
}

// setRate changes the rate from the next tick on.
func (g *generator) setRate(n int) { g.rate.Store(int64(n)) }

// finish stops generating and waits until everything generated is in INCOMING, or timeout (0:
// a minute) passes; it returns how many messages INCOMING took.
func (g *generator) finish(timeout time.Duration) int {
	if timeout == 0 {
		timeout = time.Minute
	}
	select {
	case g.stop <- struct{}{}:
	case <-g.done:
	}
	select {
	case <-g.done:
	case <-time.After(timeout):
		g.t.Errorf("the generator's publishes were not all taken by INCOMING within %v", timeout)
	}
	return int(g.sent.Load())
}

// flows waits until OUTGOING has grown by at least n messages. If it does not within a minute,
// it fails the test with how each stream is replicated.
func (e *clusterEnv) flows(n uint64) {
	e.t.Helper()
	start := e.count(e.names.Outgoing)
	deadline := time.Now().Add(time.Minute)
	for got := start; got < start+n; got = e.count(e.names.Outgoing) {
		if time.Now().After(deadline) {
			var b strings.Builder
			for _, r := range status.ReadReplication(context.Background(), e.admin, e.streams(), 5*time.Second) {
				fmt.Fprintf(&b, "\n  %+v", r)
			}
			e.t.Fatalf("OUTGOING grew by %d in a minute, want %d; streams:%s", got-start, n, b.String())
		}
		tick := time.NewTimer(50 * time.Millisecond)
		<-tick.C
	}
}

// total returns how many messages stream holds, fence records included, 0 while it cannot say.
func (e *clusterEnv) total(stream string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := e.admin.Stream(ctx, stream)
	if err != nil {
		return 0
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0
	}
	return info.State.Msgs
}

// count returns how many messages stream holds, its partitions' fence records left out
// (docs/design-fencing.md), 0 while it cannot say.
func (e *clusterEnv) count(stream string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := e.admin.Stream(ctx, stream)
	if err != nil {
		return 0
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subjects.FenceFilter(stream)))
	if err != nil {
		return 0
	}
	n := info.State.Msgs
	for _, k := range info.State.Subjects {
		n -= k
	}
	return n
}

// read returns every message stream holds now, in order. A read that fails (the cluster may
// still be settling after a restart) is started again, for up to three minutes; on an in-process
// cluster each try after the first goes through a new connection to the next node in turn.
// (CI saw the admin connection's ordered consumer refused creation for a minute after the sixth
// restart of TestClusterRidesThroughNodeLoss, while the lanes had mapped everything.)
func (e *clusterEnv) read(stream string) []jetstream.Msg {
	e.t.Helper()
	var out []jetstream.Msg
	js, try := e.admin, 0
	natstest.Eventually(e.t, 3*time.Minute, func() error {
		var err error
		if out, err = e.readOnce(js, stream); err == nil || e.c == nil {
			return err
		}
		try++
		node := try % e.c.Size()
		if js, err = jetstream.New(e.c.Connect(e.t, node)); err != nil {
			return err
		}
		return fmt.Errorf("%w (next try through %s; meta leader %d)", err, e.c.Name(node), e.c.MetaLeader())
	})
	return out
}

func (e *clusterEnv) readOnce(js jetstream.JetStream, stream string) ([]jetstream.Msg, error) {
	n := int(e.count(stream))
	if n == 0 {
		return nil, nil
	}
	records := int(e.total(stream)) - n
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", stream, err)
	}
	out := make([]jetstream.Msg, 0, n)
	for fetched := 0; len(out) < n; {
		b, err := cons.Fetch(min(max(n+records-fetched, 1), 10_000), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", stream, err)
		}
		for m := range b.Messages() {
			fetched++
			if !strings.HasPrefix(m.Subject(), subjects.FencePrefix+".") {
				out = append(out, m)
			}
		}
		if b.Error() != nil && !errors.Is(b.Error(), nats.ErrTimeout) {
			return nil, fmt.Errorf("reading %s: %w", stream, b.Error())
		}
	}
	return out, nil
}

// window is a stretch of time around a fault, for the gaps in OUTGOING.
type window struct {
	name     string
	from, to time.Time
	maxGap   time.Duration // the largest gap allowed between consecutive OUTGOING messages while one waited in INCOMING; 0: none
	// maxWait is the longest a message whose OUTGOING copy falls in the window, stored in
	// INCOMING once the first fault began, may have waited between INCOMING and OUTGOING (the
	// gap of its device); 0: no bound.
	maxWait time.Duration
	// elected, when set, is when the new leader of the stream whose leader was killed was seen:
	// the end of the largest gap is when mapping resumed, and must come within maxResume of it.
	elected   time.Time
	maxResume time.Duration
	// quiet windows name a fault whose gaps are not reported.
	quiet bool
}

// until ends every window still open at t: the next fault begins.
func until(windows []window, t time.Time) {
	for i := range windows {
		if windows[i].to.After(t) {
			windows[i].to = t
		}
	}
}

// check waits until OUTGOING and UNMAPPED hold a copy of every INCOMING message, then compares
// them message by message: for each device, OUTGOING (UNMAPPED for the strays, as no-mapping)
// must hold exactly INCOMING's payloads in INCOMING's order (no loss, duplicate or reorder), and
// no replica may have counted a reorder. It then reports, for each window, the largest gap
// between consecutive OUTGOING messages (the server's timestamps) and fails when one is above
// its bound.
func (e *clusterEnv) check(total int, windows []window) {
	e.t.Helper()
	natstest.Eventually(e.t, 2*time.Minute, func() error {
		if got := e.count(e.names.Outgoing) + e.count(e.names.Unmapped); got < uint64(total) {
			return fmt.Errorf("OUTGOING and UNMAPPED hold %d messages, want %d", got, total)
		}
		return nil
	})
	want := map[string][]string{}
	stored := map[string]time.Time{} // when INCOMING stored each payload
	where := map[string]string{}     // and where: stream and sequence
	var inTimes []time.Time
	streamTimes := map[string][]time.Time{} // each INCOMING stream's, in its order
	n := 0
	for _, s := range e.names.IncomingStreams(partitions) {
		for _, m := range e.read(s) {
			dev, _, _ := strings.Cut(string(m.Data()), ":")
			want[dev] = append(want[dev], string(m.Data()))
			if md, err := m.Metadata(); err == nil {
				stored[string(m.Data())] = md.Timestamp
				where[string(m.Data())] = fmt.Sprintf("%s#%d", s, md.Sequence.Stream)
				inTimes = append(inTimes, md.Timestamp)
				streamTimes[s] = append(streamTimes[s], md.Timestamp)
			}
			n++
		}
	}
	if n != total {
		e.t.Errorf("INCOMING holds %d messages, the generator had %d taken", n, total)
	}
	out := e.read(e.names.Outgoing)
	dead := e.read(e.names.Unmapped)
	got := map[string][]string{}
	times := make([]time.Time, len(out))
	delays := make([]time.Duration, len(out)) // from INCOMING's copy to OUTGOING's
	storedAt := make([]time.Time, len(out))   // INCOMING's copy's timestamp; zero when unknown
	for i, m := range out {
		dev, _, _ := strings.Cut(string(m.Data()), ":")
		if slices.Contains(e.strays, dev) {
			e.t.Errorf("OUTGOING holds %s on %s: %s has no group", m.Data(), m.Subject(), dev)
		}
		got[dev] = append(got[dev], string(m.Data()))
		md, err := m.Metadata()
		if err != nil {
			e.t.Fatal(err)
		}
		times[i] = md.Timestamp
		if in, ok := stored[string(m.Data())]; ok {
			delays[i] = md.Timestamp.Sub(in)
			storedAt[i] = in
		}
	}
	// waiting[i] is when the earliest INCOMING message of those OUTGOING stored from times[i] on
	// came in: every message INCOMING stored before it was in OUTGOING by times[i-1], so of a gap
	// between times[i-1] and times[i] only the part after waiting[i] had a message waiting for
	// kvmapper. The rest is the devices' own pause (a generator reconnecting to another server,
	// INCOMING electing a leader), which says nothing of kvmapper.
	waiting := make([]time.Time, len(out))
	for i := len(out) - 1; i >= 0; i-- {
		waiting[i] = times[i].Add(-delays[i])
		if i+1 < len(out) && waiting[i+1].Before(waiting[i]) {
			waiting[i] = waiting[i+1]
		}
	}
	deadTimes := make([]time.Time, len(dead))
	for i, m := range dead {
		dev, _, _ := strings.Cut(string(m.Data()), ":")
		if !slices.Contains(e.strays, dev) || m.Headers().Get(wire.HeaderReason) != wire.ReasonNoMapping {
			e.t.Errorf("UNMAPPED holds %s (%s), want only the strays' messages, as no-mapping", m.Data(), m.Headers().Get(wire.HeaderReason))
		}
		got[dev] = append(got[dev], string(m.Data()))
		md, err := m.Metadata()
		if err != nil {
			e.t.Fatal(err)
		}
		deadTimes[i] = md.Timestamp
	}
	// Per device: every INCOMING message exactly once, and in order: no message stored after a
	// later one of its device, whatever the fault — the lanes' ordered writer sends a replicated
	// output stream atomic batches, which a leader change abandons whole. kvmapper counts a
	// reorder as kvmapper_reorders_total does; its count must agree with OUTGOING's.
	var reorders []time.Time
	gotAt := map[string][]time.Time{}
	for i, m := range out {
		dev, _, _ := strings.Cut(string(m.Data()), ":")
		gotAt[dev] = append(gotAt[dev], times[i])
	}
	for i, m := range dead {
		dev, _, _ := strings.Cut(string(m.Data()), ":")
		gotAt[dev] = append(gotAt[dev], deadTimes[i])
	}
	for dev, w := range want {
		pos := make(map[string]int, len(w))
		for i, p := range w {
			pos[p] = i
		}
		seen := make(map[string]bool, len(w))
		latest := -1
		for i, p := range got[dev] {
			at, ok := pos[p]
			switch {
			case !ok:
				e.t.Errorf("device %s: OUTGOING holds %s, which INCOMING does not", dev, p)
			case seen[p]:
				e.t.Errorf("device %s: OUTGOING holds %s twice", dev, p)
			case at < latest:
				reorders = append(reorders, gotAt[dev][i])
				e.t.Logf("device %s: %s stored after %s, a later message of the device (at %s)", dev, p, w[latest], gotAt[dev][i].Format("15:04:05.000"))
			}
			seen[p] = true
			latest = max(latest, at)
		}
		for _, p := range w {
			if !seen[p] {
				e.t.Errorf("device %s: %s lost (OUTGOING holds %d of its %d messages)", dev, p, len(got[dev]), len(w))
				break
			}
		}
	}
	if len(got) != len(want) {
		e.t.Errorf("OUTGOING and UNMAPPED hold messages of %d devices, INCOMING of %d", len(got), len(want))
	}
	var dups, counted uint64
	for _, r := range e.reps {
		st := r.Stats()
		dups += st.Duplicates
		counted += st.Reorders
	}
	if counted != uint64(len(reorders)) {
		e.t.Errorf("the replicas counted %d reorders, OUTGOING holds %d", counted, len(reorders))
	}
	for _, at := range reorders {
		in := "outside every fault"
		if i := slices.IndexFunc(windows, func(w window) bool { return !at.Before(w.from) && !at.After(w.to) }); i >= 0 {
			in = "in the " + windows[i].name
		}
		e.t.Errorf("a message stored at %s after a later one of its device, %s", at.Format("15:04:05.000"), in)
	}
	e.t.Logf("%d messages of %d devices (%d in UNMAPPED); %d stored after a later one of their device; %d publishes acknowledged as duplicates",
		total, len(want), len(dead), len(reorders), dups)
	slices.SortFunc(inTimes, func(a, b time.Time) int { return a.Compare(b) })
	// A message stored before the first fault belongs to no fault: the replicas may still have
	// been settling (a partition handed to the replica it ranks first for, its new lane starting),
	// which the faults' bounds are not about. A fault that holds a partition up shows in the
	// messages stored after it began, which the load brings every few tens of milliseconds.
	var first time.Time
	for _, w := range windows {
		if first.IsZero() || w.from.Before(first) {
			first = w.from
		}
	}
	var settling time.Duration
	for i := range out {
		if !storedAt[i].IsZero() && storedAt[i].Before(first) {
			settling = max(settling, delays[i])
		}
	}
	if len(windows) > 0 {
		e.t.Logf("before the first fault: longest a message waited between INCOMING and OUTGOING %v (not bounded)", settling.Round(time.Millisecond))
	}
	for _, w := range windows {
		if w.quiet {
			continue
		}
		var gap, share, delay time.Duration
		var at time.Time
		slowest := -1 // the message that waited longest
		// A gap belongs to the window its end falls in: a fault's gap starts before it. Its
		// share is the part of it during which a message waited for kvmapper (waiting).
		for i := 1; i < len(times); i++ {
			if !times[i].After(w.from) || times[i].After(w.to) {
				continue
			}
			if d := times[i].Sub(times[i-1]); d > gap {
				gap, at = d, times[i-1]
			}
			share = max(share, times[i].Sub(later(times[i-1], waiting[i])))
		}
		for i := range out {
			if times[i].After(w.from) && !times[i].After(w.to) && !storedAt[i].Before(first) && delays[i] > delay {
				delay, slowest = delays[i], i
			}
		}
		var inGap time.Duration
		for i := 1; i < len(inTimes); i++ {
			if inTimes[i].After(w.from) && !inTimes[i].After(w.to) {
				inGap = max(inGap, inTimes[i].Sub(inTimes[i-1]))
			}
		}
		// In the streams layout each partition has an INCOMING stream, and one stream's pause
		// (its own leader change) hides among the others' messages: its largest gap too.
		var streamGap time.Duration
		var gapStream string
		if len(streamTimes) > 1 {
			for s, ts := range streamTimes {
				for i := 1; i < len(ts); i++ {
					if ts[i].After(w.from) && !ts[i].After(w.to) && ts[i].Sub(ts[i-1]) > streamGap {
						streamGap, gapStream = ts[i].Sub(ts[i-1]), s
					}
				}
			}
		}
		line := fmt.Sprintf("%s: largest gap between consecutive OUTGOING messages %v (from %s; in INCOMING %v; with a message waiting %v), longest a message waited between INCOMING and OUTGOING %v",
			w.name, gap.Round(time.Millisecond), at.Format("15:04:05.000"), inGap.Round(time.Millisecond), share.Round(time.Millisecond), delay.Round(time.Millisecond))
		if gapStream != "" {
			line += fmt.Sprintf("; one INCOMING stream's largest gap %v (%s)", streamGap.Round(time.Millisecond), gapStream)
		}
		if !w.elected.IsZero() {
			resumed := at.Add(gap).Sub(w.elected)
			line += fmt.Sprintf("; mapping resumed %v after the new leader was seen", resumed.Round(time.Millisecond))
			if resumed > w.maxResume {
				e.timely("%s: mapping resumed %v after the new leader was seen, want at most %v", w.name, resumed, w.maxResume)
			}
		}
		if slowest >= 0 {
			// Which partition's message, and when: the replicas' logs (consumer resets,
			// waits) say what held it.
			// Its device's acknowledgement says how long INCOMING took to store it for good: a
			// message is timestamped when its stream's leader proposes it, and stored once a
			// quorum has it, which a leader change can delay.
			p := string(out[slowest].Data())
			line += fmt.Sprintf(" (%s, %s, stored %s", p, where[p], storedAt[slowest].Format("15:04:05.000"))
			if e.gen != nil {
				if at, ok := e.gen.ackedAt(p); ok {
					line += fmt.Sprintf(", acknowledged to its device %v later", at.Sub(storedAt[slowest]).Round(time.Millisecond))
				}
			}
			line += ")"
		}
		e.t.Log(line)
		if w.maxGap > 0 && share > w.maxGap {
			e.timely("%s: a gap of %v between consecutive OUTGOING messages with a message waiting in INCOMING, want at most %v", w.name, share, w.maxGap)
		}
		if w.maxWait > 0 && delay > w.maxWait {
			e.timely("%s: a message waited %v between INCOMING and OUTGOING, want at most %v", w.name, delay, w.maxWait)
		}
	}
}

// replication fails the test unless every stream has a leader and current followers on
// every other node, as status reads it.
func (e *clusterEnv) replication() []status.Replication {
	e.t.Helper()
	var reps []status.Replication
	natstest.Eventually(e.t, 60*time.Second, func() error {
		reps = status.ReadReplication(context.Background(), e.admin, e.streams(), 5*time.Second)
		for _, r := range reps {
			names := []string{r.Leader}
			for _, f := range r.Followers {
				names = append(names, f.Name)
			}
			slices.Sort(names)
			if !r.Healthy() || r.Replicas != 3 || !slices.Equal(names, []string{"n0", "n1", "n2"}) {
				return fmt.Errorf("stream %s: %+v, want a leader and two current followers over n0..n2", r.Stream, r)
			}
		}
		return nil
	})
	return reps
}

// matching returns the last n lines of b that match the regular expression re.
func (b *logBuf) matching(re string, n int) string {
	r := regexp.MustCompile(re)
	var out []string
	for _, l := range strings.Split(b.String(), "\n") {
		if r.MatchString(l) {
			out = append(out, l)
		}
	}
	return strings.Join(out[max(0, len(out)-n):], "\n")
}

// abandoned fails the test when the replica whose log is logs abandoned a partition's work (it
// did not return within the election's ReleaseTimeout): that work runs on past the replica's
// Run, and past the test, where only goleak's check at the end of the package would see it,
// naming no test.
func abandoned(t *testing.T, id string, logs *logBuf) {
	t.Helper()
	if lines := logs.matching(`did not return in time`, 10); lines != "" {
		t.Errorf("%s abandoned a partition's work, which runs on past its Run:\n%s", id, lines)
	}
}

// electionDebug passes on every log line but the debug lines of components other than the
// election, and the lanes' consumer resets (a consumer replaced, which a message's wait can
// show).
type electionDebug struct{ w *logBuf }

func (f electionDebug) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte(`"level":"debug"`)) && !bytes.Contains(p, []byte(`"component":"election"`)) && !bytes.Contains(p, []byte(`"consumer reset"`)) {
		return len(p), nil
	}
	return f.w.Write(p)
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
