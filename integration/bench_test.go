package integration

import (
	"encoding/json"
	"testing"
)

// kvmapper bench --cluster starts three of its own servers as one cluster, every stream R3, and
// reports each contender's messages, rate, the servers' CPU (all three read from /proc) and the
// bytes its target stream stores, kvmapper's without the fence records a fenced OUTGOING also
// holds. Issue 33: the production default, one command away.
func TestBenchOnItsOwnCluster(t *testing.T) {
	out, errOut, code := runCLI(t, "bench", "--cluster", "3", "--messages", "2000", "--devices", "100",
		"--contenders", "kvmapper,relay-async,relay-atomic", "--json")
	if code != 0 {
		t.Fatalf("kvmapper bench --cluster 3: exit %d\n%s%s", code, out, errOut)
	}
	var rep struct {
		Config     map[string]float64 `json:"config"`
		Throughput struct {
			Contenders []struct {
				Name        string  `json:"name"`
				Messages    uint64  `json:"messages"`
				MsgsPerSec  float64 `json:"msgs_per_s"`
				ServerCPU   float64 `json:"server_cpu_s"`
				StoredBytes uint64  `json:"stored_bytes"`
			} `json:"contenders"`
			Ratio map[string]float64 `json:"ratio"`
		} `json:"throughput"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("kvmapper bench --json: %v\n%s", err, out)
	}
	if rep.Config["servers"] != 3 || rep.Config["stream_replicas"] != 3 {
		t.Errorf("config says %v servers and streams R%v, want 3 and R3", rep.Config["servers"], rep.Config["stream_replicas"])
	}
	want := map[string]bool{"kvmapper": true, "relay, async publish": true, "relay, atomic batches": true}
	for _, c := range rep.Throughput.Contenders {
		if !want[c.Name] {
			t.Errorf("contender %q ran, not asked for", c.Name)
			continue
		}
		delete(want, c.Name)
		// 128-byte payloads: whatever a contender adds, each message stores more than that.
		if c.Messages != 2000 || c.MsgsPerSec <= 0 || c.ServerCPU <= 0 || c.StoredBytes < 2000*128 {
			t.Errorf("%s: %d messages at %.0f msgs/s, servers' CPU %.2f s, %d bytes stored; want 2000, a rate, the servers' CPU and > %d bytes",
				c.Name, c.Messages, c.MsgsPerSec, c.ServerCPU, c.StoredBytes, 2000*128)
		}
		if c.Name != "kvmapper" && rep.Throughput.Ratio[c.Name] <= 0 {
			t.Errorf("no ratio of kvmapper to %s", c.Name)
		}
	}
	if len(want) > 0 {
		t.Errorf("contenders missing from the report: %v", want)
	}
}
