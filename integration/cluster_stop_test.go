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
// duplicated or reordered, no partition may change owner, and the largest gap between two
// OUTGOING messages around each stop is reported.
func TestClusterRollingStop(t *testing.T) {
	for _, sl := range []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams} {
		t.Run(string(sl), func(t *testing.T) {
			devices := deviceNames("dev-", 100)
			e := newClusterEnv(t, sl, devices)
			t.Logf("leaders: %s", leadersOf(e.replication()))
			gen := e.newGenerator(devices, targetRate)
			e.flows(500)
			owners := e.leases()
			var windows []window
			for i := range e.c.Size() {
				e.flows(500)
				until(windows, time.Now())
				stopped := time.Now()
				e.c.Stop(i)
				e.flows(uint64(2 * targetRate))
				w := window{name: fmt.Sprintf("graceful stop of %s", e.c.Name(i)), from: stopped, to: time.Now()}
				windows = append(windows, w)
				e.restart(i)
			}
			e.sameOwners("rolling stop", owners)
			e.check(gen.finish(0), windows)
		})
	}
}
