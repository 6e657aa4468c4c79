// Package deploycheck runs the deploy kit's checks (the nested module deploy/, whose Helm,
// Kubernetes and Prometheus dependencies stay out of kvmapper's own go.mod) from the root
// module, so that the README's one `go test ./...` runs every test.
package deploycheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestDeployKit runs `go -C deploy test ./...` (deploy/check: the image, the chart, the plain
// manifests, the alert rules, the dashboard and the systemd unit against the binary the image
// holds) and fails with its output when it fails. Set KVMAPPER_DEPLOY_TEST_ARGS to pass it
// flags (e.g. "-run Chart -v").
func TestDeployKit(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"-C", filepath.Join(root, "deploy"), "test", "-count=1"}
	if d, ok := t.Deadline(); ok {
		// Leave this test a minute to report what the nested run printed.
		args = append(args, "-timeout", (time.Until(d) - time.Minute).Round(time.Second).String())
	}
	args = append(args, strings.Fields(os.Getenv("KVMAPPER_DEPLOY_TEST_ARGS"))...)
	args = append(args, "./...")
	name, cmdArgs := "go", args
	// The Helm, Kubernetes and Prometheus packages take minutes to compile the first time:
	// at a lower priority than the other packages' tests on a shared machine.
	if nice, err := exec.LookPath("nice"); err == nil {
		name, cmdArgs = nice, append([]string{"-n", "10", "go"}, args...)
	}
	cmd := exec.Command(name, cmdArgs...)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("go %s (%v):\n%s", strings.Join(args, " "), time.Since(start).Round(time.Second), out)
	if err != nil {
		t.Fatalf("the deploy kit's checks failed: %v (run them alone: go -C deploy test ./...)", err)
	}
}
