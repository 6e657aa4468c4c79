package integration

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/setup"
)

// The path a user takes when INCOMING must be created again: stop kvmapper, `nats stream rm`,
// `kvmapper setup` (as setup's own mismatch message advises), start kvmapper, publish. The
// checkpoints name the old stream: honouring them would skip the new stream's messages, and
// the old Nats-Msg-Ids would have OUTGOING drop them as duplicates. Status and the log say what
// happened, and verify passes.
func TestRecreatedIncomingLosesNothing(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		devs := e.mappedDevices(20)
		ld := newLoad(t, e.js)
		ld.publish(devs, 100)
		m1 := e.startMapper("m1")
		waitAtLeast(t, e, "OUTGOING", 2000)
		m1.stop()

		for _, s := range e.names.IncomingStreams(partitions) {
			natsCLI(t, e, "stream", "rm", s, "-f")
		}
		if out, errOut, code := e.cli("setup"); code != 0 {
			t.Fatalf("kvmapper setup: exit code %d\n%s%s", code, out, errOut)
		}
		out, errOut, code := e.cli("status", "--rate-window", "0")
		if code != 0 || !strings.Contains(out, "checkpoint of an earlier INCOMING") {
			t.Fatalf("kvmapper status: exit code %d, output does not say the checkpoints belong to an earlier INCOMING:\n%s%s", code, out, errOut)
		}
		out, _, _ = e.cli("status", "--json", "--rate-window", "0")
		var snap struct {
			Partitions []struct {
				Partition int  `json:"partition"`
				Stale     bool `json:"stale_checkpoint"`
			} `json:"partitions"`
		}
		if err := json.Unmarshal([]byte(out), &snap); err != nil {
			t.Fatalf("status --json: %v\n%s", err, out)
		}
		for _, p := range snap.Partitions {
			if !p.Stale {
				t.Errorf("status --json: partition %d stale_checkpoint false, want true: every partition had a checkpoint in the old stream", p.Partition)
			}
		}

		ld.publish(devs, 25) // sequences 1..500 of the new stream (or from 1 in each new partition stream)
		m2 := e.startMapper("m2")
		m2.waitLog("the checkpoint belongs to an earlier INCOMING stream", 30*time.Second)
		perDevice(t, e.readStream("OUTGOING", 2500, 60*time.Second), each(devs, 125))
		if out, errOut, code := e.cli("verify"); code != 0 {
			t.Fatalf("kvmapper verify: exit code %d, want 0\n%s%s", code, out, errOut)
		}
		m2.stop()
	})
}

// The control bucket deleted and created again under a running replica: its leases and
// checkpoints are gone. The owner writes its checkpoints again from where it is, re-claims its
// partitions in the new bucket and goes on: nothing lost, duplicated or reordered, and verify
// does not take the epochs that start again for a deposed owner's writes.
func TestRecreatedControlBucketUnderARunningReplica(t *testing.T) {
	e := newEnv(t)
	devs := e.mappedDevices(20)
	ld := newLoad(t, e.js)
	ld.publish(devs, 100)
	m := e.startMapper("m1")
	waitAtLeast(t, e, "OUTGOING", 2000)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.js.DeleteKeyValue(ctx, "kvmapper"); err != nil {
		t.Fatalf("DeleteKeyValue(kvmapper): %v", err)
	}
	if _, err := setup.Ensure(ctx, e.js, setup.Config{Layout: layout(t)}); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	ld.publish(devs, 50)
	perDevice(t, e.readStream("OUTGOING", 3000, 90*time.Second), each(devs, 150))
	if out, errOut, code := runCLI(t, "verify", "--server", e.srv.URL()); code != 0 {
		t.Fatalf("kvmapper verify: exit code %d, want 0\n%s%s", code, out, errOut)
	}
	m.stop()
	mapped, dup := m.stoppedStats()
	if dup != 0 || mapped != 3000 {
		t.Errorf("publishes acknowledged: %v as new, %v as duplicates; want 3000 and 0: the owner restores its checkpoints, so nothing is sent again", mapped, dup)
	}
	m.waitLog("the checkpoint key was gone", time.Second)
}
