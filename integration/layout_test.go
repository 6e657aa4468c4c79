package integration

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/subjects"
)

// layoutLines returns the "stream layout" lines a replica logged.
func layoutLines(logs *logBuf) []map[string]any {
	var out []map[string]any
	for _, l := range logs.lines() {
		if l["message"] == "stream layout" {
			out = append(out, l)
		}
	}
	return out
}

// onceAtInfo checks that a replica logged its stream layout once, at info, as want.
func onceAtInfo(t *testing.T, logs *logBuf, want, why string) {
	t.Helper()
	lines := layoutLines(logs)
	if len(lines) != 1 {
		t.Fatalf("the replica logged %d \"stream layout\" lines, want 1: %v", len(lines), lines)
	}
	if l := lines[0]; l["level"] != "info" || l["layout"] != want || !strings.Contains(l["why"].(string), why) {
		t.Errorf("stream layout logged as %v; want level info, layout %s, why … %s …", l, want, why)
	}
}

// With no --layout, `run --embedded` gives a new deployment the partition streams (it sets the
// mapping on its own server); a data directory holding a single-stream deployment stays single.
func TestLayoutAutoOnTheEmbeddedServer(t *testing.T) {
	t.Run("new", func(t *testing.T) {
		logs := quickStart(t, t.TempDir(), "streams")
		onceAtInfo(t, logs, "streams", "a new deployment")
	})
	t.Run("existing single", func(t *testing.T) {
		dir := t.TempDir()
		quickStart(t, dir, "single", "--layout", "single")
		logs := quickStart(t, dir, "single")
		onceAtInfo(t, logs, "single", "recorded in bucket kvmapper")
	})
}

// Setup records the layout; run, status and verify without --layout use it, and an explicit
// --layout that contradicts it is refused, naming both.
func TestLayoutRecordedIsWhatEveryCommandUses(t *testing.T) {
	e := newEnvIn(t, subjects.PartitionStreams) // setup.Ensure --layout streams recorded it
	devs := e.mappedDevices(10)
	m := startProcess(t, "m1", append([]string{"run", "--server", e.srv.URL(), "--replica-id", "m1", "--log-format", "json"}, fastFlags...)...)
	m.waitLog("groups table loaded", 30*time.Second)
	onceAtInfo(t, m.logs, "streams", "recorded in bucket kvmapper")
	ld := newLoad(t, e.js)
	ld.publish(devs, 20)
	perDevice(t, e.readStream("OUTGOING", 200, 30*time.Second), each(devs, 20))
	if n := e.count("INCOMING-" + strconv.Itoa(subjects.Partition(devs[0], partitions))); n == 0 {
		t.Errorf("the replica without --layout left %s's stream empty", devs[0])
	}

	out, errOut, code := runCLI(t, "verify", "--server", e.srv.URL(), "--wait", "10s")
	if code != 0 || !strings.Contains(out, "partition streams INCOMING-0 … INCOMING-15") {
		t.Errorf("verify without --layout: exit %d, want 0 auditing the partition streams:\n%s%s", code, out, errOut)
	}
	out, errOut, code = runCLI(t, "status", "--server", e.srv.URL(), "--json", "--rate-window", "0")
	var snap struct {
		StreamLayout string `json:"stream_layout"`
	}
	if err := json.Unmarshal([]byte(out), &snap); code != 0 || err != nil || snap.StreamLayout != "streams" {
		t.Errorf("status without --layout: exit %d, stream_layout %q (%v), want 0 and streams:\n%s%s", code, snap.StreamLayout, err, out, errOut)
	}
	for _, command := range []string{"verify", "status", "setup", "run"} {
		_, errOut, code := runCLI(t, command, "--server", e.srv.URL(), "--layout", "single", "--log-format", "json")
		if code != 1 {
			t.Errorf("%s --layout single on a recorded streams deployment: exit %d, want 1\n%s", command, code, errOut)
		}
		for _, want := range []string{"--layout single was asked for", "records this deployment's layout as streams"} {
			if !strings.Contains(errOut, want) {
				t.Errorf("%s --layout single: stderr does not say %q:\n%s", command, want, errOut)
			}
		}
	}
	m.stop()
}

// On a server without the mapping, setup gives a new deployment the single stream and says, once,
// how to get the faster layout: the mapping block to add. A second setup is quiet about it.
func TestLayoutAutoSetupSaysHowToGetTheFasterOne(t *testing.T) {
	srv := natstest.Start(t)
	out, errOut, code := runCLI(t, "setup", "--server", srv.URL())
	if code != 0 {
		t.Fatalf("setup: exit %d:\n%s%s", code, out, errOut)
	}
	for _, want := range []string{
		"layout single (--layout auto): a new deployment on a server without the account mapping",
		"created stream INCOMING", "recorded layout single in bucket kvmapper",
		"--layout streams would map 1.4–1.8× as fast",
		"mappings {\n  \"incoming.*.*\": \"incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}\"\n}",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("setup output does not say %q:\n%s", want, out)
		}
	}
	out, _, _ = runCLI(t, "setup", "--server", srv.URL())
	if strings.Contains(out, "as fast") || !strings.Contains(out, "layout single (--layout auto): recorded in bucket kvmapper") {
		t.Errorf("second setup output, want the recorded layout and no advice:\n%s", out)
	}
}
