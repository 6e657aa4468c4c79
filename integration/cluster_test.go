package integration

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
)

// Rates of the generator: 1,000 msgs/s while the control bucket's leader is killed alone, 500
// around the other faults. The issue states its gap target at 2,000 msgs/s: that is measured
// with docs/cluster.md's recipe, without the race detector; three servers and three replicas in one
// process under -race on two shared cores do not keep elections within their bounds at that
// rate (one of about twenty took 14s).
const (
	targetRate = 1000
	faultRate  = 500
)

// killRate is the rate while the control bucket's leader is killed: targetRate, or
// KVMAPPER_TEST_RATE to measure at another (docs/cluster.md's figures: 2,000 without -race).
func killRate(t *testing.T) int {
	v := os.Getenv("KVMAPPER_TEST_RATE")
	if v == "" {
		return targetRate
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("KVMAPPER_TEST_RATE=%q: want messages a second", v)
	}
	return n
}

// newGenerator starts the load on a connection of its own to node 0 (failing over like the
// others), whose publishes time out after 2s and are then retried.
func (e *clusterEnv) newGenerator(devices []string, rate int) *generator {
	e.t.Helper()
	nc := e.c.Connect(e.t, 0, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(2*time.Second), jetstream.WithPublishAsyncMaxPending(8192))
	if err != nil {
		e.t.Fatal(err)
	}
	e.gen = startGenerator(e.t, js, devices, rate)
	return e.gen
}

// TestClusterRidesThroughNodeLoss runs kvmapper on a 3-node cluster, every stream and bucket at
// R3, its replicas connected to different nodes, under load checked message by message, through:
//   - a step-down of the control bucket's leader, of OUTGOING's, INCOMING's, UNMAPPED's and the
//     groups bucket's;
//   - a kill of the control bucket's leader alone (every other stream, and the meta group, led
//     elsewhere) at 1,000 msgs/s: no partition may change owner, and OUTGOING may not pause (at
//     most 3s between two messages under -race on a loaded machine) — unless the election
//     outlasts nats-server's timers (over 10s, the documented limit): then every partition is
//     claimed again and mapping must resume within 10s of the new leader;
//   - a kill of OUTGOING's leader (mapping resumes within 2.5s of the new leader's election), of
//     INCOMING's, of the groups bucket's (a device moves to another group after it) and of
//     UNMAPPED's (four devices of the load have no group: their messages are dead letters), each
//     led alone by its node, the meta group led elsewhere.
//
// Each kill is also the death of one replica's own server, and each killed node is restarted
// after missing writes. Nothing may be lost, duplicated or reordered (a step-down of OUTGOING's
// or UNMAPPED's leader included: the lanes write them in atomic batches), and no partition may
// change owner.
func TestClusterRidesThroughNodeLoss(t *testing.T) {
	t.Parallel() // a cluster of its own; most of the time is elections waited out
	start := time.Now()
	devices := deviceNames("dev-", 100)
	e := newClusterEnv(t, subjects.SingleStream, devices)
	for i, r := range e.reps {
		if got := r.LeaseTTL(); got != election.ReplicatedLeaseTTL {
			t.Errorf("replica r%d runs with a lease TTL of %v, want %v for an R3 control bucket", i, got, election.ReplicatedLeaseTTL)
		}
	}
	reps := e.replication()
	t.Logf("started in %v; leaders: %s", time.Since(start).Round(time.Millisecond), leadersOf(reps))
	e.strays = deviceNames("stray-", 4)
	gen := e.newGenerator(append(slices.Clone(devices), e.strays...), faultRate)
	e.flows(200)
	owners := e.leases()
	var windows []window
	control := subjects.BucketStream(e.names.Control)
	groupsStream := subjects.BucketStream(e.names.Groups)

	// Step-downs: the control bucket's first, to a node that neither the generator is connected
	// to nor leads the JetStream meta group (so that its kill below takes away nothing but the
	// control bucket's leader), then every other stream away from it.
	nc := e.c.Connect(t, 0)
	mark := time.Now()
	ctlNode := 1
	if meta := e.c.MetaLeader(); meta == ctlNode || meta < 0 && e.leader(control) == ctlNode {
		ctlNode = 2
	}
	if e.leader(control) == ctlNode {
		windows = append(windows, e.stepDown(nc, control, -1)) // away, and back below
	}
	windows = append(windows, e.stepDown(nc, control, ctlNode))
	for _, s := range []string{e.names.Outgoing, e.names.Incoming, groupsStream, e.names.Unmapped} {
		target := (ctlNode + 1 + len(s)%2) % 3 // some other node than the control bucket's leader
		if e.leader(s) == target {
			target = 3 - ctlNode - target
		}
		windows = append(windows, e.stepDown(nc, s, target))
	}
	e.flows(200)
	e.sameOwners("step-downs", owners)
	windows = append(windows, window{name: "step-downs of every stream", from: mark, to: time.Now()})

	// The control bucket's leader alone, at 1,000 msgs/s.
	for _, s := range e.streams() {
		if s != control && e.leader(s) == ctlNode {
			t.Fatalf("stream %s is led by %s, which leads %s: not alone", s, e.c.Name(ctlNode), control)
		}
	}
	// Not a meta election as well: the meta group has moved since ctlNode was chosen, if at all,
	// only by a planned step-down, which takes milliseconds.
	e.c.MoveMetaLeaderOff(ctlNode)
	rate := killRate(t)
	gen.setRate(rate)
	e.flows(1000)
	until(windows, time.Now())
	if m := e.c.MetaLeader(); m == ctlNode {
		t.Fatalf("%s leads the meta group: the kill would not be of the control bucket's leader alone", e.c.Name(m))
	}
	killed, elected := e.killAndElect(ctlNode, control)
	e.flows(uint64(2 * rate)) // two seconds of load after the election
	// The target is 1.5s at most (docs/cluster.md, measured without the race detector); the bound is wide
	// for -race on a loaded machine, and still half the pause a lease TTL below the election
	// time causes (every partition stops and moves: 6.6s measured here with 2s).
	w := window{name: fmt.Sprintf("control bucket's leader killed alone, %d msgs/s", rate), from: killed, maxGap: 3 * time.Second}
	if moved := e.moved(owners); len(moved) > 0 && elected.Sub(killed) > slowElection {
		// Not the fault under test but the limit docs/cluster.md names ("An election longer
		// than about 14 s expires the leases"): nats-server's election timers are 4–9s, and a
		// split vote on a loaded machine took 15.4s once in a README run. Then every partition
		// stops and is claimed again once the bucket is back: mapping must resume soon after
		// the new leader, and nothing be lost, duplicated or reordered (e.check).
		t.Logf("the control bucket's election took %v, past the leases' clock: %d partitions claimed again (%s)",
			elected.Sub(killed).Round(time.Millisecond), len(moved), strings.Join(moved, "; "))
		w.maxGap, w.elected, w.maxResume = 0, elected, 10*time.Second
		owners = e.stableOwners()
	} else {
		e.sameOwners("control bucket's leader killed", owners)
	}
	w.to = time.Now()
	windows = append(windows, w)
	gen.setRate(faultRate)
	e.restart(ctlNode)

	// OUTGOING's, INCOMING's, the groups bucket's and UNMAPPED's leaders, each alone too: a
	// fault at a time.
	for _, s := range []string{e.names.Outgoing, e.names.Incoming, groupsStream, e.names.Unmapped} {
		node := e.alone(nc, s, &windows)
		until(windows, time.Now())
		killed, elected := e.killAndElect(node, s)
		w := window{name: s + "'s leader killed", from: killed}
		if s == e.names.Outgoing {
			// The target is 1s; the bound is wide for a loaded machine, and still half the
			// publish timeout a lane would otherwise wait.
			w.elected, w.maxResume = elected, 2500*time.Millisecond
		}
		if s == groupsStream {
			// A device moves while the bucket has its new leader: its next messages go to
			// the new group, none of them back to the old one.
			natstest.Eventually(t, 30*time.Second, func() error {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				kv, err := e.admin.KeyValue(ctx, e.names.Groups)
				if err != nil {
					return err
				}
				_, err = kv.PutString(ctx, devices[0], "h")
				return err
			})
		}
		e.flows(1000)
		e.sameOwners(s+"'s leader killed", owners)
		w.to = time.Now()
		windows = append(windows, w)
		e.restart(node)
	}

	e.check(gen.finish(0), windows)
	e.movedOnce(devices[0], "g", "h")
	e.replication()
	t.Logf("took %v", time.Since(start).Round(time.Millisecond))
}

// TestClusterRidesThroughNodeLossPartitionStreams is the same in the streams layout, where each
// partition has its stream and its leader: a step-down of a partition stream, then the kill of
// the node that leads the most partition streams and the control bucket (and is the server of
// one replica), restarted after missing writes, then setup spreading the leaders again. Nothing may be lost, duplicated or reordered, and no partition may
// change owner.
func TestClusterRidesThroughNodeLossPartitionStreams(t *testing.T) {
	t.Parallel()
	start := time.Now()
	devices := deviceNames("dev-", 100)
	e := newClusterEnv(t, subjects.PartitionStreams, devices)
	reps := e.replication()
	t.Logf("started in %v; leaders: %s", time.Since(start).Round(time.Millisecond), leadersOf(reps))
	gen := e.newGenerator(devices, faultRate)
	e.flows(200)
	owners := e.leases()
	var windows []window

	nc := e.c.Connect(t, 0)
	mark := time.Now()
	stream := e.names.PartitionStream(subjects.Partition(devices[0], partitions))
	windows = append(windows, e.stepDown(nc, stream, -1))
	e.flows(200)
	e.sameOwners("step-down", owners)
	windows = append(windows, window{name: "step-down of " + stream, from: mark, to: time.Now()})

	led := make([]int, e.c.Size())
	for _, s := range e.names.IncomingStreams(partitions) {
		led[e.leader(s)]++
	}
	node := 0
	for i, n := range led {
		if n > led[node] {
			node = i
		}
	}
	// It leads the control bucket too: its death is an election of the control bucket and of
	// many partition streams at once.
	if control := subjects.BucketStream(e.names.Control); e.leader(control) != node {
		windows = append(windows, e.stepDown(nc, control, node))
	}
	var ledStreams []string
	for _, s := range e.streams() {
		if e.leader(s) == node {
			ledStreams = append(ledStreams, s)
		}
	}
	e.c.MoveMetaLeaderOff(node) // the kill measures the streams' elections, not the meta group's
	until(windows, time.Now())
	killed := time.Now()
	e.c.Kill(node)
	for _, s := range ledStreams {
		e.c.WaitStreamLeader(s, node, 60*time.Second)
	}
	t.Logf("killed %s (leading %s, and the server of r%d): all led again after %v", e.c.Name(node), strings.Join(ledStreams, " "), node, time.Since(killed).Round(time.Millisecond))
	e.flows(1000)
	e.sameOwners("node killed", owners)
	windows = append(windows, window{name: "kill of " + e.c.Name(node), from: killed, to: time.Now()})
	e.restart(node)
	// The restarted node leads nothing: setup, run again as docs/cluster.md says, spreads the leaders.
	windows = append(windows, e.spreadLeaders(owners))

	e.check(gen.finish(0), windows)
	e.replication()
	t.Logf("took %v", time.Since(start).Round(time.Millisecond))
}

// alone moves the leadership of every other stream, and of the meta group, off the node that
// leads stream, with step-downs (their windows appended to windows), waits until every replica
// of every stream is current, and returns that node.
func (e *clusterEnv) alone(nc *nats.Conn, stream string, windows *[]window) int {
	e.t.Helper()
	// A restarted node catches up first: a step-down to followers that are not current can
	// leave a stream without another leader for longer than a test waits (seen: KV_device-groups
	// with no leader but the one stepped down after 30 s, right after its follower's restart).
	for _, s := range e.streams() {
		e.c.WaitStreamCurrent(s, 60*time.Second)
	}
	node := e.leader(stream)
	for _, s := range e.streams() {
		if s != stream && e.leader(s) == node {
			*windows = append(*windows, e.stepDown(nc, s, -1))
		}
	}
	e.c.MoveMetaLeaderOff(node)
	for _, s := range e.streams() {
		e.c.WaitStreamCurrent(s, 60*time.Second)
	}
	for _, s := range e.streams() {
		if s != stream && e.leader(s) == node {
			e.t.Fatalf("%s leads %s again: %s's leader would not be killed alone", e.c.Name(node), s, stream)
		}
	}
	if e.c.MetaLeader() == node {
		e.t.Fatalf("%s leads the meta group again: %s's leader would not be killed alone", e.c.Name(node), stream)
	}
	return node
}

// stepDown asks stream's leader to hand over, to node to (-1: any other), and returns the
// window of the fault: the few seconds after it in which a message that fails in the handover
// is resent.
func (e *clusterEnv) stepDown(nc *nats.Conn, stream string, to int) window {
	e.t.Helper()
	start := time.Now()
	var from int
	if to < 0 {
		from, to = e.c.StepDown(nc, stream)
	} else {
		from = e.c.StepDownTo(nc, stream, to)
	}
	e.t.Logf("stepped %s down: %s → %s", stream, e.c.Name(from), e.c.Name(to))
	return window{name: "step-down of " + stream, from: start, to: time.Now().Add(5 * time.Second), quiet: true}
}

// movedOnce checks that device's messages in OUTGOING went to group from, then, from one point
// on, to group to, and never back.
func (e *clusterEnv) movedOnce(device, from, to string) {
	e.t.Helper()
	var groups []string
	for _, m := range e.read(e.names.Outgoing) {
		if tok := strings.Split(m.Subject(), "."); len(tok) == 4 && tok[2] == device {
			groups = append(groups, tok[1])
		}
	}
	switched := false
	for i, g := range groups {
		switch {
		case g == to:
			switched = true
		case g == from && switched:
			e.t.Errorf("device %s: message %d went back to group %s after the switch to %s", device, i, from, to)
			return
		case g != from:
			e.t.Errorf("device %s: message %d went to group %s", device, i, g)
			return
		}
	}
	if !switched {
		e.t.Errorf("device %s: no message went to group %s after the move", device, to)
	}
}

// leadersOf names each stream's leader.
func leadersOf(reps []status.Replication) string {
	var out []string
	for _, r := range reps {
		out = append(out, r.Stream+"="+r.Leader)
	}
	return strings.Join(out, " ")
}

// TestLeaseTTLFollowsTheControlBucket runs `kvmapper run` without --lease-ttl against one
// server: it must choose 2s for the one-replica control bucket and say so (the cluster tests
// check the 15s of an R3 bucket), and take --lease-ttl when given.
func TestLeaseTTLFollowsTheControlBucket(t *testing.T) {
	e := newEnv(t)
	m := startProcess(t, "auto", "run", "--server", e.srv.URL(), "--replica-id", "auto", "--log-format", "json")
	l := m.waitLog("lease TTL chosen", 30*time.Second)
	if l["lease_ttl_ms"] != float64(2000) || l["control_replicas"] != float64(1) {
		t.Errorf("logged %v, want lease_ttl 2000 (ms) for control_replicas 1", l)
	}
	m.stop()
	m = startProcess(t, "set", "run", "--server", e.srv.URL(), "--replica-id", "set", "--log-format", "json", "--lease-ttl", "3s")
	if l := m.waitLog("lease TTL as configured", 30*time.Second); l["lease_ttl_ms"] != float64(3000) {
		t.Errorf("logged %v, want lease_ttl 3000 (ms)", l)
	}
	m.stop()
}
