package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/wire"
)

// PartitionGap is what happened to one partition of the killed replica.
type PartitionGap struct {
	Partition int    `json:"partition"`
	NewOwner  string `json:"new_owner"`
	// KillToExpiry is the time from the kill to the lease's expiry marker (about the lease TTL).
	KillToExpiry Millis `json:"kill_to_expiry_ms"`
	// Unowned is the time from the expiry marker to the new owner's claim.
	Unowned Millis `json:"unowned_ms"`
	// KillToClaim is the time from the kill to the new owner's claim.
	KillToClaim Millis `json:"kill_to_claim_ms"`
	// KillToOutput is the time from the kill to the first message the new owner delivered.
	KillToOutput Millis `json:"kill_to_output_ms"`
}

// FailoverResult is a replica killed with SIGKILL under load, and how its partitions resumed.
type FailoverResult struct {
	Replicas int    `json:"replicas"`
	Rate     int    `json:"rate"`
	Victim   string `json:"victim"`
	// Gaps, one per partition the victim owned.
	Gaps []PartitionGap `json:"gaps"`
	// The worst of Gaps.
	MaxKillToExpiry Millis `json:"max_kill_to_expiry_ms"`
	MaxUnowned      Millis `json:"max_unowned_ms"`
	MaxKillToClaim  Millis `json:"max_kill_to_claim_ms"`
	MaxKillToOutput Millis `json:"max_kill_to_output_ms"`
	// Published into INCOMING during the run, and stored in OUTGOING at its end: Lost is the
	// difference (negative would be duplicates).
	Published uint64 `json:"published"`
	Stored    uint64 `json:"stored"`
	Lost      int64  `json:"lost"`
}

// leaseEvent is one change of a lease key, as the bench's watch saw it.
type leaseEvent struct {
	p     int
	owner string // "" when deleted or expired
	rev   uint64
	at    time.Time
}

// leases follows the lease keys of a control bucket.
type leases struct {
	mu      sync.Mutex
	owners  map[int]string
	events  []leaseEvent
	changed time.Time
}

func (l *leases) apply(ev leaseEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if prev, ok := l.owners[ev.p]; ok && prev == ev.owner {
		return // a renewal
	}
	if ev.owner == "" {
		delete(l.owners, ev.p)
	} else {
		l.owners[ev.p] = ev.owner
	}
	l.events = append(l.events, ev)
	l.changed = ev.at
}

// balanced reports whether every partition is owned, by n distinct replicas, unchanged for d.
func (l *leases) balanced(parts, n int, d time.Duration) (bool, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	count := map[string]int{}
	for _, o := range l.owners {
		count[o]++
	}
	state := fmt.Sprintf("%d/%d partitions owned by %d replicas", len(l.owners), parts, len(count))
	return len(l.owners) == parts && len(count) == n && time.Since(l.changed) >= d, state
}

// outputs records, per partition and lease epoch, when a message of it was first delivered.
type outputs struct {
	mu    sync.Mutex
	first map[[2]uint64]time.Time
}

func (o *outputs) seen(p, epoch uint64, at time.Time) {
	o.mu.Lock()
	k := [2]uint64{p, epoch}
	if _, ok := o.first[k]; !ok {
		o.first[k] = at
	}
	o.mu.Unlock()
}

func (o *outputs) get(p int, epoch uint64) (time.Time, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	t, ok := o.first[[2]uint64{uint64(p), epoch}]
	return t, ok
}

// child is a kvmapper replica process.
type child struct {
	id   string
	cmd  *exec.Cmd
	out  *tail
	done chan struct{} // closed when the process has been reaped
	err  error
}

// tail keeps the last few KiB a child wrote, for error messages.
type tail struct {
	mu sync.Mutex
	b  []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	t.b = append(t.b, p...)
	if len(t.b) > 4096 {
		t.b = t.b[len(t.b)-4096:]
	}
	t.mu.Unlock()
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(bytes.TrimSpace(t.b))
}

func (e *env) failover(ctx context.Context) (*FailoverResult, error) {
	if err := e.createIncoming(ctx); err != nil {
		return nil, err
	}
	if err := e.purgeIncoming(ctx); err != nil {
		return nil, err
	}
	_, inLast, err := e.incomingState(ctx)
	if err != nil {
		return nil, err
	}
	names := e.names("BENCH_OUT_FAILOVER")
	if err := e.ensure(ctx, names); err != nil {
		return nil, err
	}
	ctl, err := e.js.KeyValue(ctx, names.Control)
	if err != nil {
		return nil, err
	}
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	w, err := ctl.Watch(wctx, wire.LeaseFilter, jetstream.UpdatesOnly())
	if err != nil {
		return nil, err
	}
	ls := &leases{owners: map[int]string{}, changed: time.Now()}
	watchDone := make(chan struct{})
	go func() {
		defer close(watchDone)
		for entry := range w.Updates() {
			if entry == nil {
				continue
			}
			kind, p, _, ok := wire.ParseControlKey(entry.Key())
			if !ok || kind != wire.KindLease {
				continue
			}
			ev := leaseEvent{p: p, rev: entry.Revision(), at: time.Now()}
			if entry.Operation() == jetstream.KeyValuePut {
				ev.owner = string(entry.Value())
			}
			ls.apply(ev)
		}
	}()
	defer func() {
		_ = w.Stop()
		stopWatch()
		<-watchDone
	}()

	out := &outputs{first: map[[2]uint64]time.Time{}}
	sub, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench subscriber"))
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	s, err := sub.Subscribe("outgoing.>", func(m *nats.Msg) {
		now := time.Now()
		if pv, ok := wire.ReadProvenance(m.Header.Get); ok && pv.HasPartition && pv.Epoch != 0 {
			out.seen(uint64(pv.Partition), pv.Epoch, now)
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

	var children []*child
	defer func() { e.stopChildren(children) }()
	for i := range e.cfg.FailoverReplicas {
		id := fmt.Sprintf("bench-child-%d", i+1)
		c := &child{id: id, cmd: e.cfg.Child(e.cfg.URL, id, names), out: &tail{}, done: make(chan struct{})}
		c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
		if err := c.cmd.Start(); err != nil {
			return nil, fmt.Errorf("starting replica %s: %w", id, err)
		}
		go func() {
			c.err = c.cmd.Wait()
			close(c.done)
		}()
		children = append(children, c)
	}

	lctx, stopLoad := context.WithCancel(ctx)
	loadErr := make(chan error, 1)
	go func() { loadErr <- e.load(lctx, e.cfg.FailoverRate) }()
	loadStopped := false
	stop := func() error {
		if loadStopped {
			return nil
		}
		loadStopped = true
		stopLoad()
		return <-loadErr
	}
	defer func() { _ = stop() }()

	// Wait until the replicas have shared the partitions out and stay put.
	deadline := time.Now().Add(60 * time.Second)
	for {
		ok, state := ls.balanced(e.cfg.Partitions, len(children), time.Second)
		if ok {
			break
		}
		for _, c := range children {
			select {
			case <-c.done:
				return nil, fmt.Errorf("replica %s exited: %v: %s", c.id, c.err, c.out)
			default:
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("replicas not balanced within 60s: %s", state)
		}
		e.prog.show("failover: waiting for %d replicas to share the partitions: %s", len(children), state)
		if err := pause(ctx, 50*time.Millisecond); err != nil {
			return nil, err
		}
	}

	ls.mu.Lock()
	victimID := ls.owners[0]
	var parts []int
	for p, o := range ls.owners {
		if o == victimID {
			parts = append(parts, p)
		}
	}
	ls.mu.Unlock()
	slices.Sort(parts)
	i := slices.IndexFunc(children, func(c *child) bool { return c.id == victimID })
	if i < 0 {
		return nil, fmt.Errorf("partition 0 is owned by %q, not one of the bench's replicas", victimID)
	}
	victim := children[i]
	killed := time.Now()
	if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return nil, fmt.Errorf("killing %s: %w", victimID, err)
	}
	<-victim.done

	// Wait until every partition of the victim has a new owner that has delivered.
	res := &FailoverResult{Replicas: len(children), Rate: e.cfg.FailoverRate, Victim: victimID}
	deadline = time.Now().Add(60 * time.Second)
	for {
		res.Gaps = e.gaps(ls, out, parts, victimID, killed)
		if len(res.Gaps) == len(parts) {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d of the %d partitions of %s resumed within 60s of the kill", len(res.Gaps), len(parts), victimID)
		}
		e.prog.show("failover: %s killed %.1fs ago, %d/%d partitions resumed", victimID, time.Since(killed).Seconds(), len(res.Gaps), len(parts))
		if err := pause(ctx, 10*time.Millisecond); err != nil {
			return nil, err
		}
	}
	for _, g := range res.Gaps {
		res.MaxKillToExpiry = max(res.MaxKillToExpiry, g.KillToExpiry)
		res.MaxUnowned = max(res.MaxUnowned, g.Unowned)
		res.MaxKillToClaim = max(res.MaxKillToClaim, g.KillToClaim)
		res.MaxKillToOutput = max(res.MaxKillToOutput, g.KillToOutput)
	}

	// Let the new owners run under load a moment, then check nothing was lost.
	if err := pause(ctx, time.Second); err != nil {
		return nil, err
	}
	if err := stop(); err != nil {
		return nil, fmt.Errorf("publishing load: %w", err)
	}
	_, afterLast, err := e.incomingState(ctx)
	if err != nil {
		return nil, err
	}
	res.Published = afterLast - inLast
	wt, err := e.waitCount(ctx, names.Outgoing, res.Published, time.Now(), "failover: the rest")
	if err != nil {
		return nil, err
	}
	res.Stored = wt.messages
	res.Lost = int64(res.Published) - int64(res.Stored)
	e.stopChildren(children)
	children = nil
	return res, e.dropRun(ctx, names)
}

// gaps returns the gap of each partition in parts that has resumed since killed.
func (e *env) gaps(ls *leases, out *outputs, parts []int, victim string, killed time.Time) []PartitionGap {
	ls.mu.Lock()
	events := slices.Clone(ls.events)
	ls.mu.Unlock()
	var gaps []PartitionGap
	for _, p := range parts {
		var expired, claimed time.Time
		var g PartitionGap
		var epoch uint64
		for _, ev := range events {
			if ev.p != p || ev.at.Before(killed) {
				continue
			}
			if ev.owner == "" && expired.IsZero() {
				expired = ev.at
			}
			if ev.owner != "" && ev.owner != victim {
				claimed, g.NewOwner, epoch = ev.at, ev.owner, ev.rev
				break
			}
		}
		if claimed.IsZero() {
			continue
		}
		first, ok := out.get(p, epoch)
		if !ok {
			continue
		}
		g.Partition = p
		g.KillToClaim = millis(claimed.Sub(killed))
		g.KillToOutput = millis(first.Sub(killed))
		if !expired.IsZero() {
			g.KillToExpiry = millis(expired.Sub(killed))
			g.Unowned = millis(claimed.Sub(expired))
		}
		gaps = append(gaps, g)
	}
	return gaps
}

// stopChildren stops the replicas still running with SIGTERM, and kills those that do not exit
// within 20s.
func (e *env) stopChildren(children []*child) {
	for _, c := range children {
		select {
		case <-c.done:
		default:
			_ = c.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, c := range children {
		t := time.NewTimer(20 * time.Second)
		select {
		case <-c.done:
		case <-t.C:
			_ = c.cmd.Process.Kill()
			<-c.done
		}
		t.Stop()
		var ee *exec.ExitError
		if c.err != nil && !(errors.As(c.err, &ee) && !ee.Exited()) {
			e.log.Warn().Str("replica", c.id).Err(c.err).Str("output", c.out.String()).Msg("replica exited with an error")
		}
	}
}

func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
