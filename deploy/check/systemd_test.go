package check

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

func systemdFile(name string) string { return filepath.Join(built.deploy, "systemd", name) }

// unitSettings returns the unit's Key=Value lines in order (comments and sections left out).
func unitSettings(t *testing.T, text string) [][2]string {
	t.Helper()
	var out [][2]string
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || l[0] == '#' || l[0] == ';' || l[0] == '[' {
			continue
		}
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			t.Fatalf("unit line %q is not Key=Value", l)
		}
		out = append(out, [2]string{k, v})
	}
	return out
}

func setting(s [][2]string, key string) (string, bool) {
	for _, kv := range s {
		if kv[0] == key {
			return kv[1], true
		}
	}
	return "", false
}

// systemd-analyze verify accepts the unit without a word (it exits 0 even for a setting it
// ignores, so any output fails the check); the binary it names is the image's.
func TestSystemdUnitVerifies(t *testing.T) {
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Fatalf("systemd-analyze is not installed (Debian: apt-get install systemd): %v", err)
	}
	unit := readFile(t, systemdFile("kvmapper.service"))
	if !strings.Contains(unit, "ExecStart=/usr/local/bin/kvmapper ") {
		t.Fatal("ExecStart does not run /usr/local/bin/kvmapper: update the test")
	}
	p := filepath.Join(t.TempDir(), "kvmapper.service")
	if err := os.WriteFile(p, []byte(strings.ReplaceAll(unit, "/usr/local/bin/kvmapper", built.bin)), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("systemd-analyze", "verify", p).CombinedOutput()
	if err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify kvmapper.service: %v\n%s", err, out)
	}
}

// The unit's command, its variables and its env file's are ones the binary accepts; its stop
// timeout covers the drain (the binary's default drain timeout, plus the 10 s a replica allows
// for final checkpoints and releases); it does not restart after exit code 2, which is what the
// binary exits with for a bad flag or value.
func TestSystemdUnitSettingsAreKvmappers(t *testing.T) {
	s := unitSettings(t, readFile(t, systemdFile("kvmapper.service")))
	exe, _ := setting(s, "ExecStart")
	args := strings.Fields(exe)[1:]
	for i, a := range args {
		args[i] = strings.ReplaceAll(a, "${CREDENTIALS_DIRECTORY}", t.TempDir())
	}
	if out, err := exec.Command(built.bin, append(args, "--help")...).CombinedOutput(); err != nil {
		t.Errorf("kvmapper %s --help: %v\n%s", strings.Join(args, " "), err, out)
	}
	h := helpOf(t, args[0])
	var names []string
	for _, kv := range s {
		if kv[0] == "Environment" {
			name, _, _ := strings.Cut(kv[1], "=")
			names = append(names, name)
		}
	}
	envFile := readFile(t, systemdFile("kvmapper.env"))
	for _, m := range regexp.MustCompile(`(?m)^#?([A-Z][A-Z0-9_]*)=`).FindAllStringSubmatch(envFile, -1) {
		names = append(names, m[1])
	}
	if len(names) < 4 {
		t.Fatalf("found %d variables in the unit and its env file", len(names))
	}
	for _, n := range names {
		if _, ok := h.env[n]; !ok {
			t.Errorf("kvmapper %s does not read %s (the unit or kvmapper.env sets it)", args[0], n)
		}
	}
	if ef, _ := setting(s, "EnvironmentFile"); ef != "-/etc/kvmapper/kvmapper.env" {
		t.Errorf("EnvironmentFile=%s, want -/etc/kvmapper/kvmapper.env", ef)
	}

	stop, _ := setting(s, "TimeoutStopSec")
	timeout, err := time.ParseDuration(stop)
	if err != nil {
		t.Fatalf("TimeoutStopSec=%s: %v", stop, err)
	}
	drain, err := time.ParseDuration(h.defaults["drain-timeout"])
	if err != nil {
		t.Fatalf("kvmapper run --help's drain-timeout default %q: %v", h.defaults["drain-timeout"], err)
	}
	if timeout < drain+10*time.Second {
		t.Errorf("TimeoutStopSec=%s, want at least the drain timeout %v + 10s", stop, drain)
	}
	if sig, _ := setting(s, "KillSignal"); sig != "SIGTERM" {
		t.Errorf("KillSignal=%s, want SIGTERM (kvmapper hands its partitions over on it)", sig)
	}
	if r, _ := setting(s, "Restart"); r != "on-failure" && r != "always" {
		t.Errorf("Restart=%s, want on-failure", r)
	}
	prevent, _ := setting(s, "RestartPreventExitStatus")
	bad := exec.Command(built.bin, "run", "--lease-ttl", "1.5s", "--server", "nats://127.0.0.1:1")
	err = bad.Run()
	code := -1
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	}
	if want := strings.Fields(prevent); len(want) != 1 || want[0] != "2" || code != 2 {
		t.Errorf("RestartPreventExitStatus=%s, and kvmapper exits %d for a bad flag value: want both 2", prevent, code)
	}
}
