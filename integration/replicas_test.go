package integration

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"math"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

const partitions = 16

// leaseWatch follows the lease keys of the control bucket as they change.
type leaseWatch struct {
	mu     sync.Mutex
	owner  map[int]string
	events []leaseEvent
}

type leaseEvent struct {
	partition int
	owner     string // "" when the lease was deleted or expired
	at        time.Time
}

func (e *env) watchLeases() *leaseWatch {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w, err := e.ctl.Watch(ctx, "lease.*")
	if err != nil {
		e.t.Fatal(err)
	}
	lw := &leaseWatch{owner: map[int]string{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ent := range w.Updates() {
			if ent == nil {
				continue
			}
			p, err := strconv.Atoi(strings.TrimPrefix(ent.Key(), "lease."))
			if err != nil {
				continue
			}
			owner := ""
			if ent.Operation() == jetstream.KeyValuePut {
				owner = string(ent.Value())
			}
			lw.mu.Lock()
			lw.owner[p] = owner
			lw.events = append(lw.events, leaseEvent{p, owner, time.Now()})
			lw.mu.Unlock()
		}
	}()
	e.t.Cleanup(func() {
		cancel()
		<-done
	})
	return lw
}

// counts returns how many partitions each replica owns now.
func (lw *leaseWatch) counts() map[string]int {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	c := map[string]int{}
	for _, o := range lw.owner {
		if o != "" {
			c[o]++
		}
	}
	return c
}

func (lw *leaseWatch) snapshot() map[int]string {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	m := make(map[int]string, len(lw.owner))
	for p, o := range lw.owner {
		m[p] = o
	}
	return m
}

// waitBalanced waits until exactly the replicas named own all partitions, each P/n ± 1.
func (lw *leaseWatch) waitBalanced(t *testing.T, replicas ...string) map[int]string {
	t.Helper()
	lo, hi := partitions/len(replicas), (partitions+len(replicas)-1)/len(replicas)
	natstest.Eventually(t, 30*time.Second, func() error {
		c := lw.counts()
		total := 0
		for _, r := range replicas {
			if c[r] < lo || c[r] > hi {
				return fmt.Errorf("owners %v: %s owns %d, want %d to %d", c, r, c[r], lo, hi)
			}
			total += c[r]
		}
		if total != partitions {
			return fmt.Errorf("owners %v: %d partitions owned by %v, want %d", c, total, replicas, partitions)
		}
		return nil
	})
	return lw.snapshot()
}

// steadyLoad publishes to every device in rounds, paced, until stopped. Each round waits for
// INCOMING to acknowledge all of its messages.
type steadyLoad struct {
	stop chan struct{}
	hold chan bool // true pauses after the current round, false resumes
	done chan struct{}
	mu   sync.Mutex
	sent map[string]int
	err  error // why the generator stopped early; read after done is closed
}

func (e *env) startLoad(devices []string, every time.Duration) *steadyLoad {
	sl := &steadyLoad{stop: make(chan struct{}), hold: make(chan bool), done: make(chan struct{}), sent: map[string]int{}}
	// Its own connection: the test's may be busy reading.
	_, js := e.srv.JetStream(e.t, nats.MaxReconnects(-1))
	go func() {
		defer close(sl.done)
		tick := time.NewTicker(every)
		defer tick.Stop()
		paused := false
		for {
			select {
			case <-sl.stop:
				return
			case paused = <-sl.hold:
				continue
			case <-tick.C:
			}
			if paused {
				continue
			}
			var futs []jetstream.PubAckFuture
			for _, d := range devices {
				sl.mu.Lock()
				n := sl.sent[d]
				sl.mu.Unlock()
				fut, err := js.PublishAsync("incoming."+d+".evt", []byte(d+":"+strconv.Itoa(n)))
				if err != nil {
					sl.err = fmt.Errorf("publishing %s:%d to INCOMING: %w", d, n, err)
					return
				}
				futs = append(futs, fut)
				sl.mu.Lock()
				sl.sent[d]++
				sl.mu.Unlock()
			}
			for _, f := range futs {
				select {
				case <-f.Ok():
				case err := <-f.Err():
					sl.err = fmt.Errorf("INCOMING did not acknowledge %q: %w", f.Msg().Data, err)
					return
				}
			}
		}
	}()
	e.t.Cleanup(func() { sl.halt() })
	return sl
}

// pause returns once the generator has stopped between two rounds: everything it sent is in
// INCOMING. resume starts it again.
func (sl *steadyLoad) pause(t *testing.T) { sl.setHold(t, true) }

func (sl *steadyLoad) resume(t *testing.T) { sl.setHold(t, false) }

func (sl *steadyLoad) setHold(t *testing.T, hold bool) {
	t.Helper()
	select {
	case sl.hold <- hold:
	case <-sl.done:
		t.Fatalf("load generator stopped early after %d messages: %v", sl.total(), sl.err)
	}
}

// halt stops the load and returns how many messages each device was sent.
func (sl *steadyLoad) halt() map[string]int {
	select {
	case <-sl.stop:
	default:
		close(sl.stop)
	}
	<-sl.done
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return sl.sent
}

// finish is halt for a test that goes on to check the messages: it fails the test when the
// generator stopped early, since a message whose publish failed may or may not be in INCOMING
// and the counts would not say what to expect.
func (sl *steadyLoad) finish(t *testing.T) map[string]int {
	t.Helper()
	sent := sl.halt()
	if sl.err != nil {
		t.Fatalf("load generator stopped early after %d messages: %v", sl.total(), sl.err)
	}
	return sent
}

func (sl *steadyLoad) total() int {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	n := 0
	for _, c := range sl.sent {
		n += c
	}
	return n
}

// audit checks OUTGOING against what was sent, message by message, and runs `kvmapper verify`
// as a user would.
func (e *env) audit(sent map[string]int) {
	e.t.Helper()
	total := 0
	for _, n := range sent {
		total += n
	}
	perDevice(e.t, e.readStream("OUTGOING", total, 90*time.Second), sent)
	out, errOut, code := e.cli("verify", "--wait", "30s")
	if code != 0 {
		e.t.Fatalf("kvmapper verify: exit %d\n%s%s", code, out, errOut)
	}
}

// mappedDevices names n devices, all mapped to group g.
func (e *env) mappedDevices(n int) []string {
	devs := deviceNames("dev-", n)
	for _, d := range devs {
		e.put(d, "g")
	}
	return devs
}

// startReplicas starts one kvmapper process per id.
func (e *env) startReplicas(ids ...string) map[string]*mapper {
	reps := map[string]*mapper{}
	for _, id := range ids {
		reps[id] = e.startMapper(id)
	}
	return reps
}

func percentile(d []time.Duration, q float64) time.Duration {
	s := slices.Clone(d)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(i, 0)]
}

func TestThreeReplicasKillNineTakeover(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		devs := e.mappedDevices(64)
		lw := e.watchLeases()
		ids := []string{"r0", "r1", "r2"}
		reps := e.startReplicas(ids...)
		lw.waitBalanced(t, ids...)
		load := e.startLoad(devs, 10*time.Millisecond)

		kills := 10
		if os.Getenv("KVMAPPER_SOAK") != "" {
			kills = 50
		}
		var gaps []time.Duration
		for k := 0; k < kills; k++ {
			owners := lw.waitBalanced(t, ids...)
			victim := ids[k%len(ids)]
			var lost []int
			for p, o := range owners {
				if o == victim {
					lost = append(lost, p)
				}
			}
			lw.mu.Lock()
			from := len(lw.events)
			lw.mu.Unlock()
			killed := time.Now()
			reps[victim].kill()
			// Every partition of the victim gets a new owner; the gap is kill → claim.
			natstest.Eventually(t, 15*time.Second, func() error {
				lw.mu.Lock()
				defer lw.mu.Unlock()
				for _, p := range lost {
					if o := lw.owner[p]; o == "" || o == victim {
						return fmt.Errorf("partition %d not taken over yet", p)
					}
				}
				return nil
			})
			lw.mu.Lock()
			for _, p := range lost {
				for _, ev := range lw.events[from:] {
					if ev.partition == p && ev.owner != "" && ev.owner != victim {
						gaps = append(gaps, ev.at.Sub(killed))
						break
					}
				}
			}
			lw.mu.Unlock()
			reps[victim] = e.startMapper(victim)
		}
		p50, p99 := percentile(gaps, 0.5), percentile(gaps, 0.99)
		t.Logf("kill -9 ×%d, %d partitions moved: unowned gap p50 %v, p99 %v, max %v (lease TTL 1s)",
			kills, len(gaps), p50.Round(time.Millisecond), p99.Round(time.Millisecond), percentile(gaps, 1).Round(time.Millisecond))
		// Behaviour, with a wide margin for a loaded 2-core machine: takeover follows lease expiry.
		// This is not a measurement: docs/cluster.md's takeover figure comes from
		// `kvmapper bench --only failover`, run alone.
		if p99 > 3*time.Second {
			t.Errorf("unowned gap p99 %v, want well under lease TTL (1s) + 2s", p99)
		}
		e.audit(load.finish(t))
	})
}

// TestStoppedOwnerFencesItself freezes an owner with SIGSTOP while messages for its partitions
// keep arriving (its consumers take them), lets another replica take its partitions over, and
// thaws it: by its own lease clock it must send nothing under its old epochs. OUTGOING would drop
// such publishes as duplicates, so the test counts them on the wire.
func TestStoppedOwnerFencesItself(t *testing.T) {
	e := newEnv(t)
	devs := e.mappedDevices(64)
	lw := e.watchLeases()
	w := e.tapWire()
	r0 := e.startMapper("r0", "--metrics-listen", "127.0.0.1:0")
	r1 := e.startMapper("r1")
	lw.waitBalanced(t, "r0", "r1")
	r0Metrics := r0.metricsURL()
	load := e.startLoad(devs, 10*time.Millisecond)
	waitAtLeast(t, e, "OUTGOING", 2000)

	// Quiesce, so that whatever r0 publishes after the SIGSTOP it decided to publish after it:
	// every message in INCOMING is in OUTGOING, nothing of r0's is unsent.
	load.pause(t)
	natstest.Eventually(t, 30*time.Second, func() error {
		if in, out := e.count("INCOMING"), e.count("OUTGOING"); in != out {
			return fmt.Errorf("INCOMING holds %d, OUTGOING %d", in, out)
		}
		return nil
	})
	// r0's partitions and the epochs it publishes them under, from its metrics, matching the
	// leases in the control bucket.
	stale := map[int]uint64{}
	natstest.Eventually(t, 10*time.Second, func() error {
		epochs := metric(t, r0Metrics, "kvmapper_partition_epoch")
		clear(stale)
		for p, o := range lw.snapshot() {
			if o != "r0" {
				continue
			}
			ep, ok := epochs[partitionLabel(p)]
			if !ok {
				return fmt.Errorf("r0 owns partition %d but reports no epoch for it: %v", p, epochs)
			}
			stale[p] = uint64(ep)
		}
		if len(stale) == 0 || len(stale) != len(epochs) {
			return fmt.Errorf("r0 reports epochs %v, owns %v", epochs, stale)
		}
		return nil
	})

	stoppedAt := time.Now()
	if err := r0.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitState(t, r0, 'T')
	frozen := w.marker() // r0 sends nothing from here until SIGCONT
	inAtStop := e.lastSeq("INCOMING")
	load.resume(t)

	// r1 takes every partition over and maps messages published while r0 is stopped.
	natstest.Eventually(t, 15*time.Second, func() error {
		if c := lw.counts(); c["r1"] != partitions {
			return fmt.Errorf("owners %v, want r1 owning all %d", c, partitions)
		}
		live := map[int]bool{}
		for _, m := range w.since(frozen) {
			p, ep, seq := provenance(t, m.Subject, m.Header)
			if old, ok := stale[p]; ok && ep != old && seq > inAtStop {
				live[p] = true
			}
		}
		for p := range stale {
			if !live[p] {
				return fmt.Errorf("partition %d: no message published after the stop mapped by its new owner yet", p)
			}
		}
		return nil
	})
	// The fault matters: r0's consumers were handed messages published after it stopped, which
	// it holds unsent when it wakes up.
	held := e.heldByStopped(stale, stoppedAt, inAtStop)
	if len(held) == 0 {
		t.Fatalf("no consumer of r0's partitions %v delivered anything past INCOMING sequence %d while r0 was stopped: it has nothing to send on waking, so the test proves nothing", slices.Sorted(maps.Keys(stale)), inAtStop)
	}

	if err := r0.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// On waking, r0 stops those partitions on its own and rejoins with new leases.
	lw.waitBalanced(t, "r0", "r1")
	sent := load.finish(t)
	w.marker() // everything published so far is recorded

	// Nothing r0 sent after the stop carries one of its old epochs.
	var after []*nats.Msg
	for _, m := range w.since(frozen) {
		p, ep, _ := provenance(t, m.Subject, m.Header)
		if old, ok := stale[p]; ok && ep == old {
			after = append(after, m)
		}
	}
	if len(after) > 0 {
		t.Errorf("after its leases expired, the stopped owner published %d messages under its old epochs, want 0; first: %s %v",
			len(after), after[0].Subject, after[0].Header)
	}
	t.Logf("r0 stopped with partitions %v; its consumers held messages up to %v (INCOMING was at %d); after SIGCONT it published %d under its old epochs",
		stale, held, inAtStop, len(after))
	e.audit(sent)
	r0.stop()
	r1.stop()
}

// waitState waits until the mapper's process is in the given state of /proc/<pid>/stat ('T':
// stopped by a signal).
func waitState(t *testing.T, m *mapper, state byte) {
	t.Helper()
	natstest.Eventually(t, 10*time.Second, func() error {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", m.cmd.Process.Pid))
		if err != nil {
			return err
		}
		// pid (comm) state ...: comm may hold spaces, the state follows the last ')'.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) || b[i+2] != state {
			return fmt.Errorf("%s: /proc stat %q, want state %c", m.id, b, state)
		}
		return nil
	})
}

// lastSeq returns a stream's last sequence.
func (e *env) lastSeq(stream string) uint64 {
	e.t.Helper()
	s, err := e.js.Stream(context.Background(), stream)
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		e.t.Fatal(err)
	}
	return info.State.LastSeq
}

// heldByStopped returns, for the partitions a replica stopped at stoppedAt owned, the last
// INCOMING sequence past after its consumers delivered: the consumers on INCOMING filtered on
// such a partition and created before stoppedAt are the stopped replica's (the others that
// could exist stopped delivering long before).
func (e *env) heldByStopped(owned map[int]uint64, stoppedAt time.Time, after uint64) map[int]uint64 {
	e.t.Helper()
	s, err := e.js.Stream(context.Background(), "INCOMING")
	if err != nil {
		e.t.Fatal(err)
	}
	held := map[int]uint64{}
	lister := s.ListConsumers(context.Background())
	for ci := range lister.Info() {
		filters := ci.Config.FilterSubjects
		if ci.Config.FilterSubject != "" {
			filters = append(filters, ci.Config.FilterSubject)
		}
		if len(filters) != 1 || !ci.Created.Before(stoppedAt) {
			continue
		}
		tok := strings.Split(filters[0], ".")
		p, err := strconv.Atoi(tok[1])
		if _, ok := owned[p]; err != nil || !ok {
			continue
		}
		if ci.Delivered.Stream > after {
			held[p] = max(held[p], ci.Delivered.Stream)
		}
	}
	if err := lister.Err(); err != nil {
		e.t.Fatalf("listing the consumers of INCOMING: %v", err)
	}
	return held
}

func TestJoinLeaveAndRollingRestartSendNothingTwice(t *testing.T) {
	e := newEnv(t)
	devs := e.mappedDevices(64)
	lw := e.watchLeases()
	ids := []string{"r0", "r1", "r2"}
	reps := e.startReplicas(ids...)
	var stopped []*mapper
	before := lw.waitBalanced(t, ids...)
	load := e.startLoad(devs, 10*time.Millisecond)

	// A fourth replica joins: only its share moves.
	reps["r3"] = e.startMapper("r3")
	after := lw.waitBalanced(t, "r0", "r1", "r2", "r3")
	moved := 0
	for p := 0; p < partitions; p++ {
		if before[p] != after[p] {
			moved++
		}
	}
	t.Logf("3 → 4 replicas: %d of %d partitions moved", moved, partitions)
	if limit := (partitions+3)/4 + 1; moved > limit {
		t.Errorf("%d partitions moved when the fourth replica joined, want at most ceil(P/4)+1 = %d", moved, limit)
	}

	// It leaves with SIGTERM: its partitions are handed over.
	reps["r3"].stop()
	stopped = append(stopped, reps["r3"])
	lw.waitBalanced(t, ids...)

	// Rolling restart of the other three, under load.
	for _, id := range ids {
		reps[id].stop()
		stopped = append(stopped, reps[id])
		reps[id] = e.startMapper(id)
		lw.waitBalanced(t, ids...)
	}
	e.audit(load.finish(t))
	for _, id := range ids {
		reps[id].stop()
		stopped = append(stopped, reps[id])
	}
	var mapped, dups float64
	for _, m := range stopped {
		n, d := m.stoppedStats()
		mapped += n
		dups += d
	}
	if dups != 0 {
		t.Errorf("%v publishes were acknowledged as duplicates across graceful handovers, want 0: something was sent twice", dups)
	}
	if int(mapped) != load.total() {
		t.Errorf("replicas mapped %v messages in all, want exactly the %d sent", mapped, load.total())
	}
}
