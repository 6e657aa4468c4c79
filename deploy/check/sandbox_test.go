package check

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// allowedSyscalls returns the system calls the unit's SystemCallFilter= lines allow, each group
// expanded as systemd-analyze syscall-filter lists it: the first line an allow list, each "~"
// line taking its calls out again.
func allowedSyscalls(t *testing.T, lines []string) map[string]bool {
	t.Helper()
	cache := map[string][]string{}
	var expand func(group string) []string
	expand = func(group string) []string {
		if !strings.HasPrefix(group, "@") {
			return []string{group}
		}
		if calls, ok := cache[group]; ok {
			return calls
		}
		out, err := exec.Command("systemd-analyze", "syscall-filter", group).Output()
		if err != nil {
			t.Fatalf("systemd-analyze syscall-filter %s: %v", group, err)
		}
		var calls []string
		sc := bufio.NewScanner(strings.NewReader(string(out)))
		for sc.Scan() {
			l := sc.Text()
			if !strings.HasPrefix(l, " ") {
				continue // the group's own name
			}
			if l = strings.TrimSpace(l); l == "" || l[0] == '#' {
				continue
			}
			calls = append(calls, expand(l)...)
		}
		if len(calls) == 0 {
			t.Fatalf("systemd-analyze syscall-filter %s lists no system call", group)
		}
		cache[group] = calls
		return calls
	}
	allowed := map[string]bool{}
	for i, l := range lines {
		deny := strings.HasPrefix(l, "~")
		if i == 0 && deny {
			t.Fatalf("the first SystemCallFilter= line %q is a deny list: update the test", l)
		}
		for _, f := range strings.Fields(strings.TrimPrefix(l, "~")) {
			for _, c := range expand(f) {
				if deny {
					delete(allowed, c)
				} else {
					allowed[c] = true
				}
			}
		}
	}
	return allowed
}

// childOf returns the pid of a process whose parent is pid.
func childOf(t *testing.T, pid int) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid …: comm may hold spaces, so read after its last ')'.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			return child
		}
	}
	return 0
}

// A replica runs its whole life inside what the unit's sandbox does to a process, as far as it
// can be done without a running systemd: /proc mounted as ProcSubset=pid and ProtectProc=invisible
// mount it (subset=pid,hidepid=invisible, in a mount namespace of its own), and every system call
// it makes traced (strace -f) and checked against the unit's SystemCallFilter= allow list, which
// systemd enforces by killing the process (SIGSYS). It starts with the unit's environment against
// a NATS server, answers /readyz, claims every partition, maps a message, serves /metrics (the
// process collector reads /proc/self, not the /proc/stat the subset hides), and stops with exit 0
// on SIGTERM.
func TestSystemdSandboxRunsAReplica(t *testing.T) {
	for _, tool := range []string{"strace", "unshare", "systemd-analyze"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is not installed (Debian: apt-get install strace util-linux systemd): %v", tool, err)
		}
	}
	s := unitSettings(t, readFile(t, systemdFile("kvmapper.service")))
	var filters, env []string
	for _, kv := range s {
		switch kv[0] {
		case "SystemCallFilter":
			filters = append(filters, kv[1])
		case "Environment":
			env = append(env, kv[1])
		}
	}
	allowed := allowedSyscalls(t, filters)
	if sub, _ := setting(s, "ProcSubset"); sub != "pid" {
		t.Fatalf("ProcSubset=%s: the test mounts /proc as ProcSubset=pid does; update it", sub)
	}

	srv := natstest.Start(t)
	if code := start(t, "kvmapper setup", []string{"setup", "--server", srv.ClientURL()}, nil).wait(60 * time.Second); code != 0 {
		t.Fatalf("kvmapper setup exited %d", code)
	}
	port := freePort(t)
	for i, e := range env {
		if strings.HasPrefix(e, "KVMAPPER_METRICS_LISTEN=") {
			env[i] = fmt.Sprintf("KVMAPPER_METRICS_LISTEN=127.0.0.1:%d", port)
		}
	}
	env = append(env, "KVMAPPER_SERVER="+srv.ClientURL())
	trace := filepath.Join(t.TempDir(), "strace.txt")
	// 96: the mount failed; 97: /proc still shows what the subset hides.
	script := `mount -t proc -o subset=pid,hidepid=invisible proc /proc || exit 96; [ -e /proc/stat ] && exit 97; exec strace -f -qq -c -o "$0" "$@"`
	p := startCommand(t, "kvmapper run in the sandbox", "unshare", []string{"--mount", "--propagation", "private", "sh", "-c", script, trace, built.bin, "run"}, env)

	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	eventually(t, 60*time.Second, func() error {
		select {
		case <-p.done:
			t.Fatalf("the sandboxed replica exited (%v; 96: mounting /proc failed, 97: /proc/stat still there):\n%s", p.err, p.out.String())
		default:
		}
		if code, body, err := get(base + "/readyz"); err != nil || code != 200 {
			return fmt.Errorf("GET /readyz = %d %q, %v", code, body, err)
		}
		_, body, err := get(base + "/metrics")
		if err != nil || !strings.Contains(body, "\nkvmapper_partitions_owned 16\n") {
			return fmt.Errorf("the replica owns not all 16 partitions yet (%v)", err)
		}
		return nil
	})
	_, js := srv.JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	groups, err := js.KeyValue(ctx, "device-groups")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := groups.PutString(ctx, "dev-7", "g1"); err != nil {
		t.Fatal(err)
	}
	out, err := js.Stream(ctx, "OUTGOING")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, func() error {
		if _, err := js.Publish(ctx, "incoming.dev-7.temp", []byte("21.5")); err != nil {
			return err
		}
		if _, err := out.GetLastMsgForSubject(ctx, "outgoing.g1.dev-7.temp"); err != nil {
			return fmt.Errorf("nothing mapped to outgoing.g1.dev-7.temp yet: %w", err)
		}
		return nil
	})
	code, body, err := get(base + "/metrics")
	for _, want := range []string{"\nkvmapper_mapped_total ", "\nprocess_resident_memory_bytes ", "\ngo_goroutines "} {
		if err != nil || code != 200 || !strings.Contains(body, want) {
			t.Errorf("GET /metrics in the sandbox = %d, %v; want 200 with %q", code, err, strings.TrimSpace(want))
		}
	}

	replica := childOf(t, p.cmd.Process.Pid)
	if replica == 0 {
		t.Fatalf("no kvmapper process under strace (pid %d)", p.cmd.Process.Pid)
	}
	if err := syscall.Kill(replica, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(60 * time.Second); code != 0 {
		t.Fatalf("the sandboxed replica exited %d after SIGTERM, want 0:\n%s", code, p.out.String())
	}

	// strace -c's table: "% time  seconds  usecs/call  calls  errors  syscall", then "total".
	var called []string
	row := regexp.MustCompile(`^\s*[\d.]+\s+[\d.]+\s+\d+\s+\d+(?:\s+\d+)?\s+([a-z0-9_]+)\s*$`)
	for l := range strings.SplitSeq(readFile(t, trace), "\n") {
		if m := row.FindStringSubmatch(l); m != nil && m[1] != "total" {
			called = append(called, m[1])
		}
	}
	if len(called) < 20 {
		t.Fatalf("strace counted %d system calls: has its output's shape changed?\n%s", len(called), readFile(t, trace))
	}
	slices.Sort(called)
	for _, c := range called {
		if !allowed[c] {
			t.Errorf("the replica calls %s, which the unit's SystemCallFilter= (%q) does not allow: systemd would kill it with SIGSYS", c, filters)
		}
	}
	t.Logf("%d distinct system calls, all in the unit's allow list of %d: %s", len(called), len(allowed), strings.Join(called, " "))
}
