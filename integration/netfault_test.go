package integration

import (
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/subjects"
)

// The targets (issue 20) for a replica silent to the servers, killed outright or cut off:
// its partitions mapped again within takeoverBound of the fault; the judged expiry is 2s of
// writable time, and the successor's takeover (a CAS, three fence records, the checkpoint, a
// consumer) takes a few hundred ms more.
const takeoverBound = 3 * time.Second

// requireJudged fails the test unless the replicas run with a judged expiry: what the targets
// are about, and what setup's fences and the ordered writer's checked batches turn on.
func (nc *netCluster) requireJudged() {
	nc.t.Helper()
	if !nc.judged() {
		nc.t.Fatalf("the replicas run without a judged expiry (no judged_expiry in r0's log): the output streams are not fenced or the writer does not check the fences")
	}
}

// struckInFlight fails the test unless the deposed owners were writing when the fault struck:
// their last message stored within 100ms before it (at 1,000 msgs/s their partitions take one
// every few ms, and a checkpoint is written every 100ms, so the successor starts from a
// checkpoint behind what they stored and must find their tail stored already).
func (nc *netCluster) struckInFlight(what string, hs []handoff, at time.Time) {
	nc.t.Helper()
	var last time.Time
	for _, h := range hs {
		if h.lastOld.After(last) {
			last = h.lastOld
		}
	}
	if last.Before(at.Add(-100 * time.Millisecond)) {
		nc.t.Errorf("%s: the fault did not strike while the owner was writing: its last message was stored %v before the fault",
			what, at.Sub(last).Round(time.Millisecond))
	}
}

// TestNetReplicaCutOffFromEveryServer unplugs the host of a replica that owns partitions for 10s
// under load, then plugs it back. Its partitions must be mapped again within 3s of the cut by the
// others (they judge it dead after 2s of writable time), none of its messages may be stored after
// its successor's first in any partition (read from the stored messages' epochs: it stops
// writing before any other owner starts), and when the cut heals it rejoins, taking partitions
// again, with nothing lost, duplicated or reordered. While cut off it writes nothing the servers
// see; when the link comes back, its TCP connections may deliver what it had sent, which the
// output fences refuse, and the lease clock stops it 14s after its last renewal.
func TestNetReplicaCutOffFromEveryServer(t *testing.T) {
	devices := deviceNames("dev-", 100)
	nc := newNetCluster(t, devices)
	nc.requireJudged()
	gen := nc.generator(devices, targetRate)
	nc.flows(1000)
	victim := nc.reps[1]
	ps := nc.owned("r1")
	before := nc.leases()
	cut := time.Now()
	nc.lab.cut(victim)
	// Not a synchronisation: the length of the cut the issue sets.
	<-time.After(10 * time.Second)
	nc.lab.heal(victim)
	healed := time.Now()
	// When the others hand r1 its share back, r1 must claim it within their Grace, or they claim
	// it again and keep it for 5 lease TTLs, 75 s (election's graceHold): a clean-clone CI run on
	// 2026-12-07 failed here when r1 counted its lost partitions, their lanes still draining, in
	// its quota (election TestLostLeaseStillReturningIsNotCountedInTheQuota).
	natstest.Eventually(t, time.Minute, func() error {
		if len(nc.owned("r1")) == 0 {
			return fmt.Errorf("r1 owns nothing since the cut healed")
		}
		return nil
	})
	rejoined := time.Since(healed)
	nc.flows(uint64(2 * targetRate))
	total := gen.finish(0)
	nc.verify(total) // and every message is in OUTGOING: what follows reads them all
	hs := nc.handoffs(ps, before, cut)
	nc.struckInFlight("r1 cut off", hs, cut)
	nc.checkHandoffs("r1 cut off", hs, cut, takeoverBound)
	ends := nc.leaseEnds(1)
	t.Logf("r1 (partitions %v) cut off for %v; how its leases ended: %v; it owned partitions again %v after the heal and owns %v",
		ps, healed.Sub(cut).Round(time.Millisecond), ends, rejoined.Round(time.Millisecond), nc.owned("r1"))
}

// TestNetOwnerServerInTheMinority cuts server s2 off from the other two under load, its replica
// r2 (which lists s2 alone) still reaching it and s2 leading OUTGOING and UNMAPPED: s2 is in the
// minority, nothing written through it commits, its leaderships are elected again on the
// majority side, and r2, whose renewals fail, may still think it owns its partitions while the
// others take them over. The cut lasts at least 10s, and until the majority has taken every
// partition of r2 over (7-16s measured; a CI run under load healed a 10s cut before the
// majority had, and r2 then kept its partitions: safe, but the fault struck no takeover). When
// the partition heals, what r2 sends is checked against the majority's store. Nothing may be
// lost, duplicated or reordered, and none of r2's messages stored after its successor's first in
// any partition.
func TestNetOwnerServerInTheMinority(t *testing.T) {
	devices := deviceNames("dev-", 100)
	nc := newNetCluster(t, devices, netOptions{pinned: true})
	nc.requireJudged()
	nc.place(map[string]string{
		nc.names.Outgoing:                       "s2",
		nc.names.Unmapped:                       "s2",
		nc.names.Incoming:                       "s0",
		subjects.BucketStream(nc.names.Control): "s0",
		subjects.BucketStream(nc.names.Groups):  "s1",
	})
	gen := nc.generator(devices, targetRate)
	nc.flows(1000)
	ps := nc.owned("r2")
	before := nc.leases()
	// The majority's view of the leases, through s0 alone.
	conn0, err := nats.Connect(nc.urls[0], nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatalf("connecting to s0: %v", err)
	}
	defer conn0.Close()
	js0, err := jetstream.New(conn0)
	if err != nil {
		t.Fatal(err)
	}
	s2 := nc.servers[2]
	nc.lab.block(s2, nc.servers[0])
	nc.lab.block(s2, nc.servers[1])
	cut := time.Now()
	<-time.After(10 * time.Second) // the shortest cut: the one docs/cluster.md's figures were taken with
	natstest.Eventually(t, 40*time.Second, func() error {
		owners := nc.ownersVia(js0)
		for _, p := range ps {
			if o := owners[p]; o == "r2" || o == "" {
				return fmt.Errorf("partition %d: owner %q on the majority side, %v after the cut", p, o, time.Since(cut).Round(time.Millisecond))
			}
		}
		return nil
	})
	nc.lab.unblock(s2, nc.servers[0])
	nc.lab.unblock(s2, nc.servers[1])
	healed := time.Now()
	nc.flows(uint64(2 * targetRate))
	nc.verify(gen.finish(0))
	nc.checkHandoffs("s2 in the minority", nc.handoffs(ps, before, cut), cut, 0)
	t.Logf("s2, the only server of r2 (partitions %v), in the minority for %v; how r2's leases ended: %v",
		ps, healed.Sub(cut).Round(time.Millisecond), nc.leaseEnds(2))
}

// lostRouteFor is how long TestNetLostRoute keeps the route lost: 5s. Longer is not safe: the
// route's TCP connection retransmits what the loss dropped with a doubling timeout (about 0.2,
// 0.6, 1.4, 3.0, 6.2, 12.6s after it), so a loss that ends before the retransmission at ~6.2s
// is repaired then, and a longer one only at ~12.6s, past nats-server's 10s route write
// deadline: both sides close the route, and the servers then took minutes to answer the
// JetStream API again (seen with 7s and 10s: the audit could not read the groups bucket).
const lostRouteFor = 5 * time.Second

// lostRouteTries is how many times TestNetLostRoute loses the route before it gives up on
// striking a takeover: on a loaded machine (CI's README step, packages in parallel on 2 cores)
// three tries of 5s once struck none, where a quiet machine fences in 1.7-3.2s, and a CI run
// struck none in five, some of them begun before r0's lanes ran again (each try now starts
// from a settled cluster, see loseRouteSetUp). A try costs about 15s.
const lostRouteTries = 8

// TestNetLostRoute drops everything between s0 and another server L for lostRouteFor under load,
// both still reaching the third, M, each replica listing its own server alone: L leads the
// control bucket and M leads INCOMING, OUTGOING, UNMAPPED and the groups bucket. r0 (on s0) goes
// on consuming and writing through M the partitions whose consumer lives on s0 or M (L is
// chosen to hold the fewest of r0's consumers, so there are some), but its renewals cannot reach
// the control bucket's leader. The others judge it dead after 2s of writable time and take its
// partitions over while it is still writing them, by its lease clock rightly so (14s): only the
// output fences can stop it, before the route is back. So for each such partition r0 must have
// written after the loss began, its successor must have started before the route came back,
// and no message of r0's may be stored after its successor's first; nothing lost, duplicated or
// reordered. This is the case a lease clock alone cannot make safe with a takeover in seconds
// (docs/design-fencing.md). A loss that struck no such takeover (the control bucket electing
// throughout) is tried again, at most lostRouteTries times in all.
func TestNetLostRoute(t *testing.T) {
	devices := deviceNames("dev-", 100)
	nc := newNetCluster(t, devices, netOptions{pinned: true})
	nc.requireJudged()
	gen := nc.generator(devices, targetRate)
	nc.flows(1000)
	// The fault must strike a takeover while r0 still writes: the others can judge r0 dead only
	// on time the control bucket takes their writes, and the lost route can keep the control
	// bucket electing for all of lostRouteFor (s0, hearing nothing of L, calls elections the
	// others must answer; seen under the race detector on a loaded machine: every replica's
	// checkpoints refused 2s after the cut until the route was back, and no lease moved). Such a
	// try proves nothing and is made again, up to lostRouteTries times, each with the leaders
	// placed anew.
	for try := 1; ; try++ {
		ps, l, reachable := nc.loseRouteSetUp()
		ls := nc.servers[l].name
		before := nc.leases()
		nc.lab.block(nc.servers[0], nc.servers[l])
		cut := time.Now()
		// The route stays lost this long: below nats-server's write deadline (10s), which closes
		// a route it cannot write to on one side only (see docs/cluster.md: after a longer loss
		// the servers took minutes to answer the JetStream API again).
		<-time.After(lostRouteFor)
		nc.lab.unblock(nc.servers[0], nc.servers[l])
		back := time.Now()
		nc.flows(uint64(2 * targetRate))
		// Struck: a partition r0 reaches without L that r0 went on writing after the loss began
		// (a second at least) and that its successor fenced before the route was back: only the
		// output fence stopped r0 there. Others of r0's partitions may be fenced just after the
		// route is back on a loaded machine (seen in CI's README step: two at +5.24s beside two
		// at +3.68s); those are ordinary handoffs, which checkHandoffs checks as every other.
		struckIn := func(hs []handoff) (struck []int) {
			for _, h := range hs {
				if slices.Contains(reachable, h.partition) && !h.fenced.IsZero() && h.fenced.Before(back) &&
					!h.lastOld.Before(cut.Add(time.Second)) {
					struck = append(struck, h.partition)
				}
			}
			return struck
		}
		struck := struckIn(nc.handoffs(ps, before, cut))
		if len(struck) == 0 && try < lostRouteTries {
			t.Logf("try %d: no partition of r0's that it reaches without %s fenced while r0 wrote it and the route s0–%s was lost (fenced after the cut: %s): again",
				try, ls, ls, fencedAfter(nc.handoffs(ps, before, cut), cut))
			continue
		}
		if len(struck) == 0 {
			t.Errorf("no try of %d struck a takeover of a partition r0 was writing while the route was lost (fenced after the last cut: %s): this test proved nothing",
				lostRouteTries, fencedAfter(nc.handoffs(ps, before, cut), cut))
		}
		nc.verify(gen.finish(0))
		hs := nc.handoffs(ps, before, cut)
		ends := nc.leaseEnds(0)
		nc.checkHandoffs("route s0–"+ls+" lost", hs, cut, 0)
		t.Logf("try %d: route s0–%s lost for %v; partitions fenced while r0 wrote them: %v of %v it reached; how r0's leases ended: %v",
			try, ls, lostRouteFor, struck, reachable, ends)
		return
	}
}

// fencedAfter says when after at each partition of hs was fenced, for a try's log.
func fencedAfter(hs []handoff, at time.Time) string {
	var b strings.Builder
	for _, h := range hs {
		if h.fenced.IsZero() {
			fmt.Fprintf(&b, " %d: not fenced;", h.partition)
		} else {
			fmt.Fprintf(&b, " %d: +%v;", h.partition, h.fenced.Sub(at).Round(time.Millisecond))
		}
	}
	return strings.TrimSpace(b.String())
}

// loseRouteSetUp places the leaders for TestNetLostRoute and returns r0's partitions, the server
// L whose route to s0 is to be lost (the one holding the fewest of r0's consumers) and the
// partitions whose consumer r0 reaches without L.
func (nc *netCluster) loseRouteSetUp() (ps []int, l int, reachable []int) {
	nc.t.Helper()
	// After a try whose route came back, the route can take seconds more to carry (TCP's next
	// retransmission), leases can be unreadable or r0's taken over for a while, and r0's lanes
	// for partitions it claimed again not started yet (seen in CI: a try began with none of r0's
	// partitions having a consumer, and struck nothing). A try starts from a settled cluster:
	// the routes carry, every lease reads, some are r0's, each of those has a lane consumer, and
	// the owners stay the same through a second of load.
	nc.routesCarry()
	var hosts map[int][]string
	natstest.Eventually(nc.t, 2*time.Minute, func() error {
		owners := nc.owners()
		if i := slices.Index(owners, ""); i >= 0 {
			return fmt.Errorf("partition %d has no owner that can be read", i)
		}
		ps = ps[:0]
		for p, o := range owners {
			if o == "r0" {
				ps = append(ps, p)
			}
		}
		if len(ps) == 0 {
			return fmt.Errorf("r0 owns no partition (owners %v)", owners)
		}
		hosts = nc.consumerHosts()
		for _, p := range ps {
			if len(hosts[p]) == 0 {
				return fmt.Errorf("r0's partition %d has no lane consumer yet", p)
			}
		}
		nc.flows(targetRate)
		if again := nc.owners(); !slices.Equal(again, owners) {
			return fmt.Errorf("the owners moved under load: %v, then %v", owners, again)
		}
		return nil
	})
	on := func(server string) (n int) {
		for _, p := range ps {
			if slices.Contains(hosts[p], server) {
				n++
			}
		}
		return n
	}
	l, m := 1, 2
	if on("s2") < on("s1") {
		l, m = 2, 1
	}
	ls, ms := nc.servers[l].name, nc.servers[m].name
	nc.place(map[string]string{
		subjects.BucketStream(nc.names.Control): ls,
		subjects.BucketStream(nc.names.Groups):  ms,
		nc.names.Incoming:                       ms,
		nc.names.Outgoing:                       ms,
		nc.names.Unmapped:                       ms,
	})
	for _, p := range ps {
		if !slices.Contains(hosts[p], ls) {
			reachable = append(reachable, p)
		}
	}
	nc.t.Logf("r0 owns %v, their consumers on %v; the route s0–%s is to be lost, %s leads the rest; r0 reaches the consumers of %v",
		ps, hosts, ls, ms, reachable)
	return ps, l, reachable
}

// TestNetKillNineReplica kills a replica outright under load: its partitions must be mapped again
// within 3s of the kill (the others judge it dead after 2s of writable time; before the judged
// expiry, after the 15s lease TTL); nothing lost, stored twice or reordered.
func TestNetKillNineReplica(t *testing.T) {
	devices := deviceNames("dev-", 100)
	nc := newNetCluster(t, devices)
	nc.requireJudged()
	gen := nc.generator(devices, targetRate)
	nc.flows(1000)
	ps := nc.owned("r1")
	before := nc.leases()
	killed := time.Now()
	nc.repProc[1].signal(t, syscall.SIGKILL)
	nc.repProc[1].wait(t, 10*time.Second)
	natstest.Eventually(t, 60*time.Second, func() error {
		for _, p := range ps {
			if o := nc.owners()[p]; o == "r1" || o == "" {
				return fmt.Errorf("partition %d still r1's", p)
			}
		}
		return nil
	})
	nc.flows(uint64(2 * targetRate))
	nc.verify(gen.finish(0))
	hs := nc.handoffs(ps, before, killed)
	nc.struckInFlight("r1 killed", hs, killed)
	nc.checkHandoffs("r1 killed", hs, killed, takeoverBound)
}

// TestNetControlLeaderKilled kills the nats-server process leading the control bucket (SIGKILL)
// under load at 2,000 msgs/s, after moving the leadership of every other stream off it, so that
// its death is the control bucket's election alone: no partition may change owner, and OUTGOING
// may not pause more than 1.5s. The bucket takes no write for longer than the judged expiry
// (checked: its election takes seconds), which moves no partition because that time is not
// writable.
func TestNetControlLeaderKilled(t *testing.T) {
	devices := deviceNames("dev-", 100)
	nc := newNetCluster(t, devices)
	nc.requireJudged()
	gen := nc.generator(devices, 2000)
	nc.flows(2000)
	control := subjects.BucketStream(nc.names.Control)
	leader := nc.leader(control)
	other := "s0"
	if leader == "s0" {
		other = "s1"
	}
	moves := map[string]string{}
	for _, st := range []string{nc.names.Incoming, nc.names.Outgoing, nc.names.Unmapped, subjects.BucketStream(nc.names.Groups)} {
		if nc.leader(st) == leader {
			moves[st] = other
		}
	}
	nc.place(moves)
	i := slices.IndexFunc(nc.srvProc, func(p *labProc) bool { return p.name == leader })
	before := nc.leases()
	nc.flows(2000)
	killed := time.Now()
	nc.srvProc[i].signal(t, syscall.SIGKILL)
	nc.srvProc[i].wait(t, 10*time.Second)
	nc.flows(4000)
	nc.env.sameOwners("control bucket's leader killed", before)
	nc.verify(gen.finish(0))
	var all []int
	for p := range nc.lay.Partitions {
		all = append(all, p)
	}
	gap, _ := nc.resumed(all, killed)
	silent := nc.electedAfter(control, killed)
	t.Logf("%s, the control bucket's leader (alone), killed: its next leader elected %v after; OUTGOING's largest gap with a message waiting in INCOMING %v",
		leader, silent.Round(time.Millisecond), gap.Round(time.Millisecond))
	if silent <= 2*time.Second {
		t.Errorf("the control bucket elected its next leader %v after the kill, not longer than the judged expiry (2s): the fault did not test it", silent)
	}
	if gap > 1500*time.Millisecond {
		t.Errorf("OUTGOING paused %v with a message waiting in INCOMING when the control bucket's leader died, want at most 1.5s", gap)
	}
}
