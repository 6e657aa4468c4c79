package check

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
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

// backoffDropIn is the drop-in for systemd 254 and later, beside the unit.
const backoffDropIn = "kvmapper.service.d/10-restart-backoff.conf"

// systemdVersion returns the version of systemd-analyze here (252 for "systemd 252 (252.38-1)").
func systemdVersion(t *testing.T) int {
	t.Helper()
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Fatalf("systemd-analyze is not installed (Debian: apt-get install systemd): %v", err)
	}
	out, err := exec.Command("systemd-analyze", "--version").Output()
	m := regexp.MustCompile(`^systemd (\d+)`).FindSubmatch(out)
	if err != nil || m == nil {
		t.Fatalf("systemd-analyze --version: %v: %q", err, out)
	}
	v, _ := strconv.Atoi(string(m[1]))
	return v
}

// unitDir writes the unit, running the image's binary, into a directory of its own, with the
// given drop-ins of deploy/systemd beside it, and returns the unit's path.
func unitDir(t *testing.T, dropIns ...string) string {
	t.Helper()
	unit := readFile(t, systemdFile("kvmapper.service"))
	if !strings.Contains(unit, "ExecStart=/usr/local/bin/kvmapper ") {
		t.Fatal("ExecStart does not run /usr/local/bin/kvmapper: update the test")
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "kvmapper.service")
	if err := os.WriteFile(p, []byte(strings.ReplaceAll(unit, "/usr/local/bin/kvmapper", built.bin)), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, d := range dropIns {
		dst := filepath.Join(dir, filepath.FromSlash(d))
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, []byte(readFile(t, systemdFile(d))), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// systemd-analyze verify accepts the unit without a word (it exits 0 even for a setting it
// ignores, so any output fails the check); the binary it names is the image's. With the back-off
// drop-in beside it (verify reads drop-ins from there), a systemd of 254 or later says nothing
// either, and an older one only that it does not know RestartSteps and RestartMaxDelaySec: the
// drop-in is otherwise accepted, and that is why it is a drop-in.
func TestSystemdUnitVerifies(t *testing.T) {
	version := systemdVersion(t)
	out, err := exec.Command("systemd-analyze", "verify", unitDir(t)).CombinedOutput()
	if err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify kvmapper.service: %v\n%s", err, out)
	}
	out, err = exec.Command("systemd-analyze", "verify", unitDir(t, backoffDropIn)).CombinedOutput()
	if err != nil {
		t.Errorf("systemd-analyze verify kvmapper.service with %s: %v\n%s", backoffDropIn, err, out)
	}
	if version >= 254 {
		if len(out) > 0 {
			t.Errorf("systemd %d: systemd-analyze verify kvmapper.service with %s:\n%s", version, backoffDropIn, out)
		}
		return
	}
	unknown := regexp.MustCompile(`^\S*10-restart-backoff\.conf:\d+: Unknown key '(RestartSteps|RestartMaxDelaySec)' in section \[Service\], ignoring\.$`)
	seen := map[string]bool{}
	for l := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		m := unknown.FindStringSubmatch(l)
		if m == nil {
			t.Errorf("systemd %d: systemd-analyze verify with %s says %q: only RestartSteps and RestartMaxDelaySec may be unknown to it", version, backoffDropIn, l)
			continue
		}
		seen[m[1]] = true
	}
	if !seen["RestartSteps"] || !seen["RestartMaxDelaySec"] {
		t.Errorf("systemd %d: systemd-analyze verify with %s did not read its RestartSteps and RestartMaxDelaySec (%q): was the drop-in read?", version, backoffDropIn, out)
	}
	t.Logf("systemd %d here: the drop-in's back-off keys are known from 254 on", version)
}

// restartPolicy is how systemd restarts a unit that keeps failing: the delay before each
// restart (RestartSec=, growing to RestartMaxDelaySec= in RestartSteps= steps on systemd 254 and
// later) and the start limit (StartLimitBurst= starts in StartLimitIntervalSec=, 5 in 10 s unless
// set; an interval of 0 is none), past which the unit is left failed.
type restartPolicy struct {
	sec, maxDelay time.Duration
	steps         int
	limitInterval time.Duration
	limitBurst    int
}

// policyOf reads the policy of the unit's settings, later settings (drop-ins) over earlier ones.
func policyOf(t *testing.T, s [][2]string) restartPolicy {
	t.Helper()
	p := restartPolicy{sec: 100 * time.Millisecond, limitInterval: 10 * time.Second, limitBurst: 5}
	dur := func(k, v string) time.Duration {
		if regexp.MustCompile(`^\d+$`).MatchString(v) {
			v += "s"
		}
		v = strings.ReplaceAll(strings.ReplaceAll(v, "min", "m"), "sec", "s")
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("%s=%s: %v", k, v, err)
		}
		return d
	}
	for _, kv := range s {
		switch kv[0] {
		case "RestartSec":
			p.sec = dur(kv[0], kv[1])
		case "RestartMaxDelaySec":
			p.maxDelay = dur(kv[0], kv[1])
		case "RestartSteps":
			p.steps, _ = strconv.Atoi(kv[1])
		case "StartLimitIntervalSec":
			p.limitInterval = dur(kv[0], kv[1])
		case "StartLimitBurst":
			p.limitBurst, _ = strconv.Atoi(kv[1])
		}
	}
	return p
}

// delay is the wait before restart n (1 the first), as systemd 254's service_restart_usec_next
// computes it: RestartSec, then growing geometrically to RestartMaxDelaySec at step RestartSteps.
func (p restartPolicy) delay(n int) time.Duration {
	if n <= 1 || p.steps == 0 || p.maxDelay <= p.sec || p.sec == 0 {
		return p.sec
	}
	if n > p.steps {
		return p.maxDelay
	}
	return time.Duration(float64(p.sec) * math.Pow(float64(p.maxDelay)/float64(p.sec), float64(n-1)/float64(p.steps)))
}

// outage plays a NATS unreachable for down: each start of the replica fails after run and is
// restarted after the policy's delay. It returns when the unit would be left failed by its start
// limit (0: never) and the longest wait between two starts.
func (p restartPolicy) outage(run, down time.Duration) (failedAt, longest time.Duration) {
	var starts []time.Duration
	now := time.Duration(0)
	for n := 1; now < down; n++ {
		starts = append(starts, now)
		if p.limitInterval > 0 {
			in := 0
			for _, s := range starts {
				if now-s < p.limitInterval {
					in++
				}
			}
			if in > p.limitBurst {
				return now, longest
			}
		}
		wait := run + p.delay(n)
		longest = max(longest, wait)
		now += wait
	}
	return 0, longest
}

// A replica started while NATS is unreachable exits at once with a status the unit restarts
// after (not 2); the unit then keeps restarting it through an outage of a day, never left failed
// by a start limit, and never waits more than a minute between two starts, so that it runs again
// soon after NATS answers: with the unit as shipped (systemd before 254 reads only that) and with
// the back-off drop-in as systemd 254 and later read it.
func TestSystemdUnitRestartsUntilNATSAnswers(t *testing.T) {
	s := unitSettings(t, readFile(t, systemdFile("kvmapper.service")))
	began := time.Now()
	p := start(t, "kvmapper run, NATS unreachable", []string{"run", "--server", fmt.Sprintf("nats://127.0.0.1:%d", freePort(t))},
		[]string{"KVMAPPER_LOG_FORMAT=json", "KVMAPPER_METRICS_LISTEN=127.0.0.1:0"})
	code := p.wait(30 * time.Second)
	run := time.Since(began)
	prevent, _ := setting(s, "RestartPreventExitStatus")
	if code == 0 || slices.Contains(strings.Fields(prevent), strconv.Itoa(code)) {
		t.Fatalf("kvmapper run with NATS unreachable exited %d: the unit (Restart=on-failure, RestartPreventExitStatus=%s) would not restart it", code, prevent)
	}
	t.Logf("with NATS unreachable kvmapper run exits %d after %v", code, run.Round(time.Millisecond))
	for name, settings := range map[string][][2]string{
		"the unit":                      s,
		"the unit and " + backoffDropIn: append(slices.Clone(s), unitSettings(t, readFile(t, systemdFile(backoffDropIn)))...),
	} {
		pol := policyOf(t, settings)
		failedAt, longest := pol.outage(run, 24*time.Hour)
		switch {
		case failedAt > 0:
			t.Errorf("%s: NATS unreachable for %v leaves the unit failed for good (StartLimitBurst=%d in StartLimitIntervalSec=%v; restarts %v apart)", name, failedAt.Round(time.Second), pol.limitBurst, pol.limitInterval, pol.delay(1))
		case longest > time.Minute:
			t.Errorf("%s: %v between two starts during an outage; want at most a minute, so that the replica runs soon after NATS answers", name, longest)
		default:
			t.Logf("%s: restarts %v, %v, %v, … %v apart at most; never failed", name, pol.delay(1), pol.delay(2), pol.delay(3), longest.Round(time.Millisecond))
		}
	}
}

// The unit has the hardening lines of nats-server's hardened unit (PrivateUsers, ProcSubset=pid,
// ProtectProc=invisible, PrivateIPC, UMask=0077, a system call allow list of @system-service
// without @privileged and @resources) and systemd takes each as meant: systemd-analyze security
// (offline, on the unit file) finds every one of its checks of them passed, and the unit's
// overall exposure no higher than it is now.
func TestSystemdUnitHardening(t *testing.T) {
	systemdVersion(t)
	s := unitSettings(t, readFile(t, systemdFile("kvmapper.service")))
	var filters []string
	for _, kv := range s {
		if kv[0] == "SystemCallFilter" {
			filters = append(filters, kv[1])
		}
	}
	for k, want := range map[string]string{"PrivateUsers": "yes", "ProcSubset": "pid", "ProtectProc": "invisible", "PrivateIPC": "yes", "UMask": "0077"} {
		if got, _ := setting(s, k); got != want {
			t.Errorf("%s=%s, want %s (nats-server's hardened unit)", k, got, want)
		}
	}
	if !slices.Equal(filters, []string{"@system-service", "~@privileged @resources"}) {
		t.Errorf("SystemCallFilter lines %q, want @system-service and ~@privileged @resources (a ~ list on a line of its own)", filters)
	}
	out, err := exec.Command("systemd-analyze", "security", "--offline=yes", "--json=short", unitDir(t)).Output()
	if err != nil {
		t.Fatalf("systemd-analyze security --offline=yes: %v\n%s", err, out)
	}
	var checks []struct {
		Set         bool    `json:"set"`
		Name        string  `json:"name"`
		Description string  `json:"description"`
		Exposure    *string `json:"exposure"`
	}
	if err := json.Unmarshal(out, &checks); err != nil {
		t.Fatalf("systemd-analyze security --json: %v\n%s", err, out)
	}
	byName := map[string]bool{}
	exposure := 0.0
	for _, c := range checks {
		byName[c.Name] = c.Set
		if !c.Set && c.Exposure != nil {
			e, _ := strconv.ParseFloat(*c.Exposure, 64)
			exposure += e
		}
	}
	for _, name := range []string{"PrivateUsers=", "ProcSubset=", "ProtectProc=", "UMask=", "SystemCallFilter=~@privileged", "SystemCallFilter=~@resources",
		"NoNewPrivileges=", "ProtectSystem=", "ProtectHome=", "PrivateTmp=", "PrivateDevices=", "RestrictNamespaces=~user", "MemoryDenyWriteExecute="} {
		set, ok := byName[name]
		if !ok {
			t.Errorf("systemd-analyze security has no check %q (its checks: %d)", name, len(checks))
		} else if !set {
			t.Errorf("systemd-analyze security: %s not satisfied by the unit", name)
		}
	}
	// What is left is what a network client needs: the host's network, Internet and local
	// sockets, the host's root, mounts, an IP allow list (the NATS servers are the user's).
	if exposure > 1.5 {
		t.Errorf("the unit's exposure adds up to %.1f of systemd-analyze security's weights, want at most 1.5 (as shipped)", exposure)
	}
	t.Logf("exposure of the unsatisfied checks: %.1f", exposure)
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
