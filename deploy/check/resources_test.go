package check

import (
	"encoding/json"
	"os/exec"
	"testing"
)

// The command that measured the chart's resource requests runs and reports the replica's CPU
// and memory: here at a low rate for a few seconds (the figures themselves are taken at 50k
// msgs/s on a quiet machine; docs/deploy-kubernetes.md has them).
func TestResourcesCommandMeasures(t *testing.T) {
	cmd := exec.Command("go", "run", "./cmd/resources", "-kvmapper", built.bin,
		"-rate", "2000", "-devices", "50", "-warmup", "2s", "-duration", "3s")
	cmd.Dir = built.deploy
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("go run ./cmd/resources: %v\n%s%s", err, out, stderr)
	}
	var r struct {
		Mapped  float64 `json:"mapped_rate"`
		Cores   float64 `json:"replica_cores"`
		PerMsg  float64 `json:"replica_cpu_us_per_msg"`
		RSSPeak float64 `json:"replica_rss_peak_mib"`
		Load    string  `json:"loadavg_before"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("its output is not the JSON report: %v\n%s", err, out)
	}
	t.Logf("%s", out)
	if r.Mapped < 1000 || r.PerMsg <= 0 || r.RSSPeak <= 0 || r.Load == "" {
		t.Errorf("report %+v: want a mapped rate near 2000/s, CPU per message, the peak memory and the load", r)
	}
}
