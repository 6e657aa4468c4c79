package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/wire"
)

// TestObserve runs two replicas and looks at them the ways an operator would: kvmapper status,
// the nats CLI's micro commands, the metrics endpoint and the ownership events, before and
// after one replica is killed.
func TestObserve(t *testing.T) {
	e := newEnv(t)
	events, err := e.nc.SubscribeSync(status.DefaultEventsSubject)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Flush(); err != nil { // the mappers publish on their own connections
		t.Fatal(err)
	}
	r0 := e.startMapper("r0", "--metrics-listen", "127.0.0.1:0")
	r1 := e.startMapper("r1", "--metrics-listen", "127.0.0.1:0")
	metricsURL := map[string]string{}
	for _, m := range []*mapper{r0, r1} {
		addr, _ := m.waitLog("metrics listening", 10*time.Second)["addr"].(string)
		if addr == "" {
			t.Fatalf("%s logged no metrics address", m.id)
		}
		metricsURL[m.id] = "http://" + addr
	}

	devices := deviceNames("obs", 40)
	for _, d := range devices {
		e.put(d, "group-a")
	}
	ld := newLoad(t, e.js)
	ld.publish(devices, 10)
	e.readStream("OUTGOING", ld.total(), 30*time.Second)

	// kvmapper status: all 16 partitions owned by r0 and r1, checkpoints as in the bucket, no lag.
	var snap *status.Snapshot
	natstest.Eventually(t, 30*time.Second, func() error {
		var err error
		if snap, err = statusJSON(t, e); err != nil {
			return err
		}
		if len(snap.Partitions) != 16 {
			return fmt.Errorf("status lists %d partitions, want 16", len(snap.Partitions))
		}
		owners := map[string]int{}
		for _, p := range snap.Partitions {
			owners[p.Owner]++
			if p.Owner != "r0" && p.Owner != "r1" {
				return fmt.Errorf("partition %d owned by %q, want r0 or r1", p.Partition, p.Owner)
			}
			if p.Lag != 0 || p.LagFrom != "replica" {
				return fmt.Errorf("partition %d: lag %d from %q, want 0 from the owner's report", p.Partition, p.Lag, p.LagFrom)
			}
			ent, err := e.ctl.Get(context.Background(), "checkpoint."+strconv.Itoa(p.Partition))
			if err != nil {
				return fmt.Errorf("checkpoint.%d: %w", p.Partition, err)
			}
			if cp, err := wire.ParseCheckpoint(ent.Value()); err != nil || cp.Seq != p.Checkpoint {
				return fmt.Errorf("partition %d: status checkpoint %d, bucket %q (%v)", p.Partition, p.Checkpoint, ent.Value(), err)
			}
			if p.Epoch == 0 {
				return fmt.Errorf("partition %d: no epoch", p.Partition)
			}
		}
		if owners["r0"] == 0 || owners["r1"] == 0 {
			return fmt.Errorf("owners %v, want both replicas", owners)
		}
		if len(snap.Replicas) != 2 || snap.Replicas[0].Report == nil || snap.Replicas[1].Report == nil {
			return fmt.Errorf("replicas %+v, want r0 and r1 with reports", snap.Replicas)
		}
		return nil
	})
	var r0Parts []int
	for _, p := range snap.Partitions {
		if p.Owner == "r0" {
			r0Parts = append(r0Parts, p.Partition)
		}
	}
	out, errOut, code := runCLI(t, "status", "--server", e.srv.URL(), "--rate-window", "0")
	if code != 0 || !regexp.MustCompile(`(?m)^REPLICA\s+HOST`).MatchString(out) {
		t.Errorf("kvmapper status: exit %d, output:\n%s%s", code, out, errOut)
	}

	// The nats CLI lists both instances of the micro service, each with its status endpoint.
	var infos []struct {
		Name      string            `json:"name"`
		Metadata  map[string]string `json:"metadata"`
		Endpoints []struct {
			Subject    string `json:"subject"`
			QueueGroup string `json:"queue_group"`
		} `json:"endpoints"`
	}
	if err := json.Unmarshal(natsCLI(t, e, "micro", "ls", "--json"), &infos); err != nil {
		t.Fatalf("nats micro ls --json: %v", err)
	}
	var ids []string
	for _, in := range infos {
		if in.Name == status.ServiceName && len(in.Endpoints) == 1 && in.Endpoints[0].QueueGroup == "" &&
			in.Endpoints[0].Subject == status.StatusSubject("kvmapper", in.Metadata["replica"]) {
			ids = append(ids, in.Metadata["replica"])
		}
	}
	slices.Sort(ids)
	if !slices.Equal(ids, []string{"r0", "r1"}) {
		t.Errorf("nats micro ls: kvmapper instances %v, want [r0 r1]", ids)
	}
	natsCLI(t, e, "micro", "info", "kvmapper")
	natsCLI(t, e, "micro", "stats", "kvmapper")

	// Metrics: both replicas together mapped every message.
	natstest.Eventually(t, 10*time.Second, func() error {
		total := 0.0
		for id, url := range metricsURL {
			body := httpGet(t, url+"/metrics")
			m := regexp.MustCompile(`(?m)^kvmapper_mapped_total (\S+)$`).FindStringSubmatch(body)
			if m == nil {
				return fmt.Errorf("%s /metrics has no kvmapper_mapped_total", id)
			}
			v, _ := strconv.ParseFloat(m[1], 64)
			total += v
			for _, name := range []string{"kvmapper_partitions_owned", "kvmapper_partition_lag_messages", "kvmapper_unowned_gap_seconds_bucket", "kvmapper_table_devices 40", "kvmapper_control_watch_restarts_total 0"} {
				if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name)).MatchString(body) {
					return fmt.Errorf("%s /metrics lacks %s", id, name)
				}
			}
		}
		if int(total) != ld.total() {
			return fmt.Errorf("kvmapper_mapped_total r0+r1 = %v, want %d", total, ld.total())
		}
		return nil
	})
	if body := httpGet(t, metricsURL["r1"]+"/readyz"); body != "ready\n" {
		t.Errorf("GET /readyz = %q, want ready", body)
	}

	// Kill r0: r1 publishes one event per partition it takes over, naming r0 and the gap.
	for {
		if _, err := events.NextMsg(10 * time.Millisecond); err != nil {
			break // drained the events of the start-up and rebalancing
		}
	}
	r0.kill()
	want := map[int]bool{}
	for _, p := range r0Parts {
		want[p] = true
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(want) > 0 {
		m, err := events.NextMsg(time.Until(deadline))
		if err != nil {
			t.Fatalf("ownership events: still waiting for partitions %v of r0: %v", want, err)
		}
		var ev status.Event
		if err := json.Unmarshal(m.Data, &ev); err != nil {
			t.Fatalf("event %q: %v", m.Data, err)
		}
		if ev.OldOwner != "r0" || ev.NewOwner != "r1" {
			continue
		}
		if ev.Replica != "r1" || ev.Epoch == 0 || ev.UnownedGapMS < 0 || ev.At.IsZero() {
			t.Errorf("takeover event %+v: want replica r1, an epoch, a gap and a time", ev)
		}
		t.Logf("partition %d: r0 → r1, epoch %d, resumes after %d, unowned %d ms", ev.Partition, ev.Epoch, ev.ResumeSeq, ev.UnownedGapMS)
		delete(want, ev.Partition)
	}
}

// statusJSON runs kvmapper status --json against the env's server.
func statusJSON(t *testing.T, e *env) (*status.Snapshot, error) {
	t.Helper()
	out, errOut, code := runCLI(t, "status", "--json", "--server", e.srv.URL(), "--rate-window", "0")
	if code != 0 {
		return nil, fmt.Errorf("kvmapper status --json: exit %d: %s", code, errOut)
	}
	var s status.Snapshot
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		return nil, fmt.Errorf("kvmapper status --json: %w\n%s", err, out)
	}
	return &s, nil
}

// natsCLI runs the nats CLI pinned in go.mod against the env's server and returns its stdout.
func natsCLI(t *testing.T, e *env, args ...string) []byte {
	t.Helper()
	cmd := exec.Command("go", append([]string{"tool", "nats", "--server", e.srv.URL()}, args...)...)
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("go tool nats %v: %v\n%s%s", args, err, out, stderr)
	}
	return out
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
