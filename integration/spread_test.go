package integration

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
)

// TestSetupSpreadsPartitionLeaders runs `kvmapper setup --layout streams --stream-replicas 3`
// against a 3-node cluster whose servers have the account mapping: it spreads the partition
// streams' leaders 5 or 6 to a server, `--no-balance-leaders` leaves them where they are (here
// all on one server, handed there on purpose), and `kvmapper status` counts them per server.
func TestSetupSpreadsPartitionLeaders(t *testing.T) {
	lay := layout(t)
	c := natstest.StartCluster(t, 3, func(o *server.Options) {
		acc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
		if err := acc.AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
			t.Fatal(err)
		}
		o.Accounts = []*server.Account{acc}
	})
	nc := c.Connect(t, 0)
	conn := []string{"--server", c.URLs(0), "--layout", "streams"}
	setupArgs := append([]string{"setup", "--stream-replicas", "3"}, conn...)
	status := append([]string{"status", "--rate-window", "0"}, conn...)
	leaders := func() map[string]int {
		t.Helper()
		counts := map[string]int{"n0": 0, "n1": 0, "n2": 0}
		for p := range lay.Partitions {
			counts[c.Name(c.WaitStreamLeader(fmt.Sprintf("INCOMING-%d", p), -1, 30*time.Second))]++
		}
		return counts
	}
	run := func(args ...string) string {
		t.Helper()
		out, errOut, code := runCLI(t, args...)
		if code != 0 {
			t.Fatalf("kvmapper %s: exit code %d, want 0; stdout %q stderr %q", strings.Join(args, " "), code, out, errOut)
		}
		return out
	}
	even := func(counts map[string]int, said string) {
		t.Helper()
		for s, n := range counts {
			if n < 5 || n > 6 {
				t.Errorf("%s leads %d partition streams, want 5 or 6; all %v; kvmapper setup said:\n%s", s, n, counts, said)
			}
		}
	}

	out := run(setupArgs...)
	t.Logf("kvmapper setup said:\n%s", out)
	even(leaders(), out)
	if !strings.Contains(out, "leaders over 3 servers: ") {
		t.Errorf("kvmapper setup does not say where the partition streams' leaders are:\n%s", out)
	}

	for p := range lay.Partitions {
		if name := fmt.Sprintf("INCOMING-%d", p); c.WaitStreamLeader(name, -1, 30*time.Second) != 0 {
			c.StepDownTo(nc, name, 0)
		}
	}
	out = run(append(setupArgs, "--no-balance-leaders")...)
	if got := leaders(); got["n0"] != 16 {
		t.Errorf("kvmapper setup --no-balance-leaders moved leaders: %v, want all 16 still on n0; it said:\n%s", got, out)
	}
	if strings.Contains(out, "leaders") {
		t.Errorf("kvmapper setup --no-balance-leaders speaks of leaders:\n%s", out)
	}
	if out := run(status...); !strings.Contains(out, "partition streams led per server: n0 16, n1 0, n2 0 (uneven: `kvmapper setup` spreads them)\n") {
		t.Errorf("kvmapper status does not count 16 partition streams led by n0 and none by the others:\n%s", out)
	}

	out = run(setupArgs...)
	counts := leaders()
	even(counts, out)
	if !strings.Contains(out, "spread the partition streams' leaders over 3 servers: ") || !strings.Contains(out, "they were n0 16, n1 0, n2 0") {
		t.Errorf("kvmapper setup does not say it spread the leaders from n0 16, n1 0, n2 0:\n%s", out)
	}
	var want []string
	for _, s := range slices.Sorted(maps.Keys(counts)) {
		want = append(want, fmt.Sprintf("%s %d", s, counts[s]))
	}
	if out := run(status...); !strings.Contains(out, "partition streams led per server: "+strings.Join(want, ", ")+"\n") {
		t.Errorf("kvmapper status does not count the leaders as %s:\n%s", strings.Join(want, ", "), out)
	}
}

// spreadLeaders runs setup with BalanceLeaders, as `kvmapper setup` does, while the replicas map
// under load, and checks that every server then leads 5 or 6 of the 16 partition streams and
// that no partition changed owner. A partition stream's step-down must not reverse any device's
// messages (no window excuses a reorder).
func (e *clusterEnv) spreadLeaders(owners []string) window {
	e.t.Helper()
	start := time.Now()
	cfg := e.scfg
	cfg.BalanceLeaders = true
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	lines, err := setup.Ensure(ctx, e.admin, cfg)
	if err != nil {
		e.t.Fatalf("setup.Ensure(BalanceLeaders) under load: %v", err)
	}
	said := lines[len(lines)-1]
	e.t.Logf("setup under load, in %v: %s", time.Since(start).Round(time.Millisecond), said)
	led := map[string]int{}
	for i := range e.c.Size() {
		led[e.c.Name(i)] = 0
	}
	for _, s := range e.names.IncomingStreams(partitions) {
		led[e.c.Name(e.leader(s))]++
	}
	for s, n := range led {
		if n < 5 || n > 6 {
			e.timely("after setup under load, %s leads %d partition streams, want 5 or 6; all %v; setup said %q", s, n, led, said)
		}
	}
	e.flows(200)
	e.sameOwners("leaders spread by setup", owners)
	return window{name: "setup spreading the leaders", from: start, to: time.Now().Add(5 * time.Second), quiet: true}
}
