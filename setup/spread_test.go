package setup_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// mappedCluster starts a 3-node cluster whose servers all map the device subjects of lay into
// partitions, as each server's configuration file would, and returns it with a JetStream
// context on node 0.
func mappedCluster(t *testing.T, lay *subjects.Layout) (*natstest.Cluster, *nats.Conn, jetstream.JetStream) {
	t.Helper()
	c := natstest.StartCluster(t, 3, func(o *server.Options) {
		acc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
		if err := acc.AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
			t.Fatal(err)
		}
		o.Accounts = []*server.Account{acc}
	})
	nc := c.Connect(t, 0)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return c, nc, js
}

// partitionLeaders counts, from the servers themselves, how many partition streams each running
// node leads, waiting for every stream to have a leader.
func partitionLeaders(t *testing.T, c *natstest.Cluster, cfg setup.Config) map[string]int {
	t.Helper()
	counts := map[string]int{}
	for i := range c.Size() {
		if c.Server(i) != nil {
			counts[c.Name(i)] = 0
		}
	}
	for _, name := range cfg.IncomingStreams(cfg.Layout.Partitions) {
		counts[c.Name(c.WaitStreamLeader(name, -1, 30*time.Second))]++
	}
	return counts
}

// skew hands every partition stream's leadership to node to.
func skew(t *testing.T, c *natstest.Cluster, nc *nats.Conn, cfg setup.Config, to int) {
	t.Helper()
	for _, name := range cfg.IncomingStreams(cfg.Layout.Partitions) {
		if c.WaitStreamLeader(name, -1, 30*time.Second) != to {
			c.StepDownTo(nc, name, to)
		}
	}
}

// evenly fails the test unless every server in counts leads partitions/len(counts), give or
// take one: the floor or the ceiling of the share.
func evenly(t *testing.T, counts map[string]int, partitions int, said string) {
	t.Helper()
	lo := partitions / len(counts)
	hi := (partitions + len(counts) - 1) / len(counts)
	for _, s := range slices.Sorted(maps.Keys(counts)) {
		if n := counts[s]; n < lo || n > hi {
			t.Errorf("after Ensure(BalanceLeaders), %s leads %d partition streams, want %d to %d (%d over %d servers); all: %v; setup said %q",
				s, n, lo, hi, partitions, len(counts), counts, said)
		}
	}
}

// TestEnsureSpreadsPartitionLeaders starts from the worst placement, every partition stream
// led by one server (JetStream's own placement is uneven too, but not always), and checks that
// setup without BalanceLeaders moves nothing, that with it every server then leads 5 or 6 of
// the 16, and that a second run finds them spread and moves nothing.
func TestEnsureSpreadsPartitionLeaders(t *testing.T) {
	t.Parallel()
	cfg := streamsConfig(t, 16)
	cfg.Replicas = 3
	cfg.Defaults()
	c, nc, js := mappedCluster(t, cfg.Layout)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	lines, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	t.Logf("as JetStream elected them: %v", partitionLeaders(t, c, cfg))

	skew(t, c, nc, cfg, 0)
	again, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure without BalanceLeaders: %v", err)
	}
	if len(again) != len(lines) {
		t.Errorf("Ensure without BalanceLeaders reported %d lines, want %d as before: %q", len(again), len(lines), again)
	}
	if got := partitionLeaders(t, c, cfg); got["n0"] != 16 {
		t.Fatalf("after Ensure without BalanceLeaders, leaders %v, want all 16 still on n0", got)
	}

	cfg.BalanceLeaders = true
	start := time.Now()
	lines, err = setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure(BalanceLeaders): %v", err)
	}
	said := lines[len(lines)-1]
	t.Logf("Ensure(BalanceLeaders) took %v: %s", time.Since(start).Round(time.Millisecond), said)
	counts := partitionLeaders(t, c, cfg)
	evenly(t, counts, 16, said)
	if want := "spread the partition streams' leaders over 3 servers: " + formatCounts(counts); !strings.HasPrefix(said, want) {
		t.Errorf("Ensure(BalanceLeaders)'s last line %q, want %q…", said, want)
	}
	if !strings.Contains(said, "they were n0 16, n1 0, n2 0") {
		t.Errorf("Ensure(BalanceLeaders)'s last line %q, want it to say they were n0 16, n1 0, n2 0", said)
	}

	lines, err = setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("second Ensure(BalanceLeaders): %v", err)
	}
	said = lines[len(lines)-1]
	if want := "partition streams' leaders over 3 servers: " + formatCounts(counts) + " (no two differ by more than one)"; said != want {
		t.Errorf("second Ensure(BalanceLeaders)'s last line %q, want %q", said, want)
	}
	if got := partitionLeaders(t, c, cfg); !maps.Equal(got, counts) {
		t.Errorf("second Ensure(BalanceLeaders) moved leaders: %v, want %v as before", got, counts)
	}
}

// TestEnsureSpreadsPartitionLeadersOverServersUp kills a server that leads nothing, once its
// peers have stopped hearing from it, and checks that setup spreads the leaders over the two
// left (8 each) without handing one to the dead server: to the streams' info it is still
// neither offline nor behind.
func TestEnsureSpreadsPartitionLeadersOverServersUp(t *testing.T) {
	t.Parallel()
	cfg := streamsConfig(t, 16)
	cfg.Replicas = 3
	cfg.Defaults()
	c, nc, js := mappedCluster(t, cfg.Layout)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := setup.Ensure(ctx, js, cfg); err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	// The node to kill leads nothing, so that no stream has to elect a leader: not the meta
	// group, not a stream or bucket.
	dead, alive := 2, 1
	skew(t, c, nc, cfg, alive)
	for _, s := range []string{cfg.Outgoing, cfg.Unmapped, subjects.BucketStream(cfg.Groups), subjects.BucketStream(cfg.Control)} {
		if c.WaitStreamLeader(s, -1, 30*time.Second) == dead {
			c.StepDownTo(nc, s, alive)
		}
	}
	c.MoveMetaLeaderOff(dead)
	c.Kill(dead)
	natstest.Eventually(t, 30*time.Second, func() error {
		s, err := js.Stream(ctx, cfg.PartitionStream(0))
		if err != nil {
			return err
		}
		for _, r := range s.CachedInfo().Cluster.Replicas {
			if r.Name == c.Name(dead) && r.Active < 3*time.Second {
				return fmt.Errorf("%s's leader heard from %s %v ago", cfg.PartitionStream(0), r.Name, r.Active)
			}
		}
		return nil
	})

	cfg.BalanceLeaders = true
	lines, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure(BalanceLeaders): %v", err)
	}
	said := lines[len(lines)-1]
	counts := partitionLeaders(t, c, cfg)
	if len(counts) != 2 || counts[c.Name(alive)] != 8 {
		t.Errorf("after Ensure(BalanceLeaders) with %s dead, leaders %v, want 8 on each of the two servers up; setup said %q", c.Name(dead), counts, said)
	}
	if want := "spread the partition streams' leaders over 2 servers: " + formatCounts(counts) + " (no two differ by more than one; moved 8"; !strings.HasPrefix(said, want) {
		t.Errorf("Ensure(BalanceLeaders)'s last line %q, want %q…", said, want)
	}
}

// formatCounts writes counts as setup does: "n0 5, n1 5, n2 6".
func formatCounts(counts map[string]int) string {
	var parts []string
	for _, s := range slices.Sorted(maps.Keys(counts)) {
		parts = append(parts, fmt.Sprintf("%s %d", s, counts[s]))
	}
	return strings.Join(parts, ", ")
}

// TestEnsureWarnsWhenLeadersCannotMove runs setup as a user who may not ask for a step-down:
// spreading fails, and Ensure says so in a warning line naming what to run by hand, and
// succeeds, since the streams work wherever they are led.
func TestEnsureWarnsWhenLeadersCannotMove(t *testing.T) {
	t.Parallel()
	cfg := streamsConfig(t, 16)
	cfg.Replicas = 3
	cfg.Defaults()
	lay := cfg.Layout
	c := natstest.StartCluster(t, 3, func(o *server.Options) {
		acc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
		if err := acc.AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
			t.Fatal(err)
		}
		o.Accounts = []*server.Account{acc}
		o.Users = []*server.User{
			{Username: "admin", Password: "admin", Account: acc},
			{Username: "setup", Password: "setup", Account: acc, Permissions: &server.Permissions{
				Publish: &server.SubjectPermission{Allow: []string{">"}, Deny: []string{"$JS.API.STREAM.LEADER.STEPDOWN.>"}},
			}},
		}
	})
	admin := c.Connect(t, 0, nats.UserInfo("admin", "admin"))
	ajs, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := setup.Ensure(ctx, ajs, cfg); err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	skew(t, c, admin, cfg, 0)

	js, err := jetstream.New(c.Connect(t, 0, nats.UserInfo("setup", "setup"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})))
	if err != nil {
		t.Fatal(err)
	}
	cfg.BalanceLeaders = true
	lines, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure(BalanceLeaders) without the step-down permission = %v, want success with a warning", err)
	}
	said := lines[len(lines)-1]
	t.Log(said)
	for _, want := range []string{"warning: the partition streams' leaders may not be spread over the servers (leaders now n0 16, n1 0, n2 0): asking INCOMING-",
		"no answer within 2s: may this user publish to $JS.API.STREAM.LEADER.STEPDOWN.INCOMING-",
		"setup goes on", "`nats stream cluster step-down INCOMING-"} {
		if !strings.Contains(said, want) {
			t.Errorf("Ensure(BalanceLeaders)'s last line %q, want it to say %q", said, want)
		}
	}
	if got := partitionLeaders(t, c, cfg); got["n0"] != 16 {
		t.Errorf("leaders %v after a refused spread, want all 16 still on n0", got)
	}
}
