package integration

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/subjects"
)

// TestClusterRollingStop stops each server of the 3-node cluster gracefully in turn, as SIGTERM
// does (nats-server's Shutdown: the Raft groups it leads hand over first, its clients are
// closed), under load, restarting it before the next, in both layouts. Nothing may be lost,
// duplicated or reordered, no partition may change owner, OUTGOING may not pause for more than
// 3s, and no message may wait more than 4s between INCOMING and OUTGOING (without the race
// detector: under it these bounds are only logged, see timely). The waits and gaps it logs are the figures of
// docs/cluster.md.
func TestClusterRollingStop(t *testing.T) {
	t.Parallel()
	for _, sl := range []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams} {
		t.Run(string(sl), func(t *testing.T) {
			t.Parallel() // a cluster of its own per layout
			devices := deviceNames("dev-", 100)
			e := newClusterEnv(t, sl, devices)
			t.Logf("leaders: %s", leadersOf(e.replication()))
			gen := e.newGenerator(devices, faultRate)
			e.flows(500)
			owners := e.leases()
			var windows []window
			stops := e.c.Size()
			if raceEnabled {
				// Under the race detector one stop per layout: three servers and three replicas in
				// one process restarted three times in a row have left a partition stream
				// unreadable for minutes on a loaded machine (2 runs in 7), which says nothing of
				// kvmapper. `go test ./...` stops all three.
				stops = 1
			}
			for i := range stops {
				e.flows(500)
				until(windows, time.Now())
				// A graceful stop of the server leading an output stream hands the leadership over
				// with messages of a device in flight: the ordered writer's atomic batches keep
				// them in order (e.check allows no reorder).
				ledOutput := e.c.StreamLeader(e.names.Outgoing) == i || e.c.StreamLeader(e.names.Unmapped) == i
				t.Logf("stopping %s (leads an output stream: %v)", e.c.Name(i), ledOutput)
				stopped := time.Now()
				e.c.Stop(i)
				e.flows(uint64(2 * faultRate))
				// The target is a second (issue 20), measured on a quiet run and logged below: a
				// stop cost 2.0–2.1s per device before (a consumer on the stopped server replaced
				// slowly), up to 5s, and a lane that waited for missing heartbeats and a new
				// lease ~8s. This test asserts the behaviour with a wide margin: no OUTGOING pause
				// over 3s and no message waiting over 4s. A bound of 1.5s failed once in the
				// README's parallel `go test ./...` (2.37s, one partition's consumer re-created
				// twice while the other packages' servers shared the 2 cores). The second itself is
				// guarded where one lane runs alone: lanes' TestConsumerOfAStoppedServerIsReplacedAtOnce.
				windows = append(windows, window{name: fmt.Sprintf("graceful stop of %s", e.c.Name(i)), from: stopped, to: time.Now(),
					maxGap: 3 * time.Second, maxWait: 4 * time.Second})
				e.restart(i)
			}
			e.sameOwners("rolling stop", owners)
			e.check(gen.finish(0), windows)
		})
	}
}
