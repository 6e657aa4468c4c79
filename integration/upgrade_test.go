package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/internal/natstest"
	replica "github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/wire"
)

// upgradeLeaseTTL is the lease TTL of the rolling-upgrade drill: shorter than a cluster's 15 s
// to keep the test short, far above the judged expiry (2 s).
const upgradeLeaseTTL = 10 * time.Second

// startDrillReplica runs replica id on a cluster as `kvmapper run` wires it, connected to node i
// first, its control-plane connection dialed through cut, until the end of the test; mod
// changes its configuration.
func startDrillReplica(t *testing.T, c *natstest.Cluster, i int, id string, scfg setup.Config, cut *natstest.Dropper, mod func(*replica.Config)) *replica.Replica {
	t.Helper()
	opts := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(20 * time.Millisecond), nats.ReconnectBufSize(-1)}
	js, err := jetstream.New(c.Connect(t, i, opts...))
	if err != nil {
		t.Fatal(err)
	}
	control, err := jetstream.New(c.Connect(t, i, append(opts, nats.SetCustomDialer(cut))...))
	if err != nil {
		t.Fatal(err)
	}
	lcfg, ecfg := runDefaults(scfg.Layout)
	ecfg.LeaseTTL = upgradeLeaseTTL
	logs := &logBuf{}
	log := zerolog.New(electionDebug{logs}).Level(zerolog.DebugLevel).With().Timestamp().Str("replica", id).Logger()
	cfg := replica.Config{ID: id, Setup: scfg, Lanes: lcfg, Election: ecfg, Logger: log, Control: control}
	if mod != nil {
		mod(&cfg)
	}
	r, err := replica.New(context.Background(), js, cfg)
	if err != nil {
		t.Fatalf("replica.New(%s): %v", id, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() { done <- r.Run(ctx, func() { close(ready) }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
			abandoned(t, id, logs)
		case <-time.After(60 * time.Second):
			t.Errorf("%s: Run did not return within 60s of cancel", id)
		}
		if t.Failed() {
			t.Logf("warnings and errors of %s:\n%s", id, logs.matching(`"level":"(warn|error)"`, 40))
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
	return r
}

// TestJudgeLeavesAnUncheckedOwnerToItsLease is the rolling upgrade across the fencing change
// (issue 35, 1a) with one build: r1 writes unchecked, as a replica of the old build does
// (lanes.Config.Unfenced: no fence records, no checks), beside r0 and r2, which fence and check.
// r1 and r2 are cut off from the control bucket at once (their publishes to it vanish, as when
// their servers lost the route to its leader) while they go on writing OUTGOING. r0 takes r2's
// partitions over after the judged expiry (2 s of writable time): r2 advertises, on its
// renewals, that it writes checked, and r0's fence records refuse it. r1's it must leave to
// their lease: r1 never said it writes checked, and nothing would refuse what it writes after
// a takeover — before, every replica was judged alike, and r1 wrote beside its successors until
// its own lease clock ran out.
func TestJudgeLeavesAnUncheckedOwnerToItsLease(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	lay := layout(t)
	scfg := setup.Config{Layout: lay, Replicas: 3}
	scfg.Defaults()
	admin, err := jetstream.New(c.Connect(t, 0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := setup.Ensure(ctx, admin, scfg); err != nil {
		t.Fatalf("setup.Ensure(3 replicas): %v", err)
	}
	cuts := []*natstest.Dropper{{}, {}, {}}
	reps := make([]*replica.Replica, 3)
	for i := range reps {
		var mod func(*replica.Config)
		if i == 1 {
			mod = func(cfg *replica.Config) { cfg.Lanes.Unfenced = true }
		}
		reps[i] = startDrillReplica(t, c, i, "r"+strconv.Itoa(i), scfg, cuts[i], mod)
	}
	natstest.Eventually(t, 60*time.Second, func() error {
		n := 0
		for i, r := range reps {
			if len(r.Owned()) == 0 {
				return fmt.Errorf("r%d owns nothing yet", i)
			}
			n += r.Serving()
		}
		if n != partitions {
			return fmt.Errorf("the replicas serve %d partitions, want %d", n, partitions)
		}
		return nil
	})
	unchecked, checked := reps[1].Owned(), reps[2].Owned()
	// r2's leases vouch once it renewed them after its lanes fenced their outputs (a claim
	// vouches for nothing); r1's never do.
	natstest.Eventually(t, 10*time.Second, func() error {
		for _, p := range checked {
			m, err := kvcas.Latest(ctx, admin, scfg.Control, wire.LeaseKey(p))
			if err != nil {
				return err
			}
			if got := m.Header.Get("Kvmapper-Lease-Checked"); got != "v1 OUTGOING,UNMAPPED" {
				return fmt.Errorf("r2's lease %d carries Kvmapper-Lease-Checked %q, want v1 OUTGOING,UNMAPPED", p, got)
			}
		}
		return nil
	})

	cut := time.Now()
	cuts[1].Drop("$KV." + scfg.Control + ".")
	cuts[2].Drop("$KV." + scfg.Control + ".")
	// r2's partitions show the fault struck and the judge works: r0 takes them after about 2 s.
	natstest.Eventually(t, 3*replica.DefaultJudgedExpiry+2*time.Second, func() error {
		owned := reps[0].Owned()
		for _, p := range checked {
			if !slices.Contains(owned, p) {
				return fmt.Errorf("r0 owns %v, not yet r2's partition %d (r2 writes checked and went silent %v ago)", owned, p, time.Since(cut))
			}
		}
		return nil
	})
	took := time.Since(cut)
	owned := reps[0].Owned()
	for _, p := range unchecked {
		if slices.Contains(owned, p) {
			t.Errorf("r0 took partition %d of r1, which writes unchecked, %v after r1 went silent: before its lease (%v) could expire, beside r1's writes",
				p, took.Round(time.Millisecond), upgradeLeaseTTL)
		}
	}
	if took >= upgradeLeaseTTL-time.Second {
		t.Fatalf("r0 took r2's partitions only %v after the cut, near their lease TTL %v: the test proves nothing", took, upgradeLeaseTTL)
	}
	t.Logf("r2's partitions %v taken by r0 %v after the cut; r1's %v left to their lease", checked, took.Round(time.Millisecond), unchecked)
	for _, d := range cuts {
		d.Drop("")
	}
}
