package docs

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The shell blocks a page marks "*Run by the docs check" are run by TestCommands, in sessions: a
// session is the marked blocks of its pages, in order, against one kvmapper started by the first
// `run --embedded` among them. The pages' own conventions are what the check reads:
//
//   - A comment that starts its line (`# …`) shows what the command before it prints: that
//     line must appear in the command's output, or in the output of a command the block started
//     in the background (`&`), since the command started. `…` stands for anything within a line.
//   - An indented comment continues the comment of the line above, and is not checked.
//   - `go run .` and `kvmapper` are the kvmapper binary this test builds (`go run .` builds the
//     same package); `nats` is the pinned `go tool nats`; `<replica-id>` is the replica's id.
//   - `go test ./...` is not run: this test is part of it.
//
// The commands run as the pages write them, with bash, in the repository's root. The port is the
// one thing a session changes: kvmapper run --embedded listens on 127.0.0.1:4222 as the pages
// say, which would collide with another session, another package's test or a kvmapper the user
// runs. So every session sets KVMAPPER_LISTEN=127.0.0.1:-1 (the --listen flag's environment
// variable; -1 is a free port the server picks), reads the URL the replica prints, and sets
// NATS_URL, which both the nats CLI and kvmapper's --server read, for the commands after it.
// KVMAPPER_DATA_DIR puts its data in a temporary directory and KVMAPPER_REPLICA_ID names the
// replica; NATS_* and KVMAPPER_* variables of the caller's environment are dropped.
//
// What a person at a terminal does by being slow, the session does by waiting on what the next
// command needs, each to a deadline: after `run`, for the next steps it prints (which come once
// every partition is served); after a background command, for its first output (`nats sub`
// prints before it subscribes, and flushes its subscription right after; what it is there to see
// is published only after the next command's process has started, connected and published);
// after `nats kv put`, until the replica's groups table has applied the put (its status
// endpoint); for a command that only reads (`nats stream get`, `kvmapper verify`, status…), by
// running it again until it shows its lines; for any other, by reading the background output
// until the lines arrive. A `--watch` command runs until it shows its lines, then gets Ctrl-C.

// sessions are the pages whose marked blocks run together against one kvmapper. docs/verify.md,
// docs/observe.md and docs/replay.md go on from the README's walkthrough, on its deployment.
var sessions = []struct {
	name  string
	pages []string
}{
	{"walkthrough", []string{"README.md", "docs/verify.md", "docs/observe.md", "docs/replay.md"}},
	{"direct", []string{"docs/modes-and-layouts.md"}},
	{"parking", []string{"docs/parking.md"}},
	{"metadata", []string{"docs/metadata.md"}},
}

const (
	runMarker    = "*Run by the docs check"
	notRunMarker = "*Not run as written by the docs check"
)

// replicaID is the id every session's replica runs under.
const replicaID = "docs-check"

// TestCommands runs every shell block the pages mark as run by the docs check, as described
// above, and fails when a command fails or does not print what its page shows.
func TestCommands(t *testing.T) {
	bin, env := prepare(t)
	for _, s := range sessions {
		var blocks []sessionBlock
		for _, path := range s.pages {
			p := readPage(t, filepath.Join(root, path))
			for _, b := range p.blocks {
				if b.info == "sh" && strings.HasPrefix(b.after, runMarker) {
					blocks = append(blocks, sessionBlock{path, b})
				}
			}
		}
		if len(blocks) == 0 {
			t.Errorf("session %s: no block of %v is marked %q", s.name, s.pages, runMarker)
			continue
		}
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			sh := newShell(t, bin, env)
			for _, sb := range blocks {
				for _, c := range parseBlock(t, sb.path, sb.block) {
					sh.do(c)
				}
			}
			sh.stop()
		})
	}
}

// TestEveryCommandBlockSaysHowItIsChecked requires every shell block of the pages to be followed
// by a paragraph that says either that the docs check runs it (and then a session runs its page)
// or why not, naming the test that runs the same scenario instead.
func TestEveryCommandBlockSaysHowItIsChecked(t *testing.T) {
	inSession := map[string]bool{}
	for _, s := range sessions {
		for _, p := range s.pages {
			inSession[filepath.Join(root, p)] = true
		}
	}
	for _, path := range pages(t) {
		p := readPage(t, path)
		if strings.HasPrefix(filepath.Base(path), "BENCHMARKS") {
			// A benchmark report's commands produce its figures and take minutes: one paragraph
			// near its top says so, for all of them, and names the tests that run the same code.
			if !regexp.MustCompile(regexp.QuoteMeta(notRunMarker) + `[^\n]*(\n[^\n]+)*Test[A-Z]`).MatchString(p.prose) {
				t.Errorf("%s: a benchmark report without a paragraph starting %q that names the tests running its code", path, notRunMarker)
			}
			continue
		}
		for _, b := range p.blocks {
			if b.info != "sh" {
				continue
			}
			switch {
			case strings.HasPrefix(b.after, runMarker):
				if !inSession[path] {
					t.Errorf("%s:%d: marked %q, but no session of TestCommands runs %s", path, b.line, runMarker, path)
				}
			case strings.HasPrefix(b.after, notRunMarker):
				if !testNameRE.MatchString(b.after) {
					t.Errorf("%s:%d: %q names no test that runs the same scenario: %s", path, b.line, notRunMarker, b.after)
				}
			default:
				t.Errorf("%s:%d: a shell block followed neither by %q nor by %q and the test that runs its scenario: %q",
					path, b.line, runMarker, notRunMarker, b.after)
			}
		}
	}
}

type sessionBlock struct {
	path  string
	block block
}

// command is one command of a block: as written, less its trailing comment and `&`.
type command struct {
	where      string   // file:line
	text       string   // the command as written
	background bool     // it ended in &
	want       []string // the comment lines after it: what it prints
}

// parseBlock splits b into its commands and the output lines each shows.
func parseBlock(t *testing.T, path string, b block) []command {
	t.Helper()
	var cmds []command
	for i, l := range b.lines {
		where := fmt.Sprintf("%s:%d", path, b.line+1+i)
		switch {
		case strings.TrimSpace(l) == "":
		case strings.HasPrefix(l, "#"):
			if len(cmds) == 0 {
				t.Fatalf("%s: an output line before any command: %q", where, l)
			}
			w := strings.TrimSpace(strings.TrimPrefix(l, "#"))
			cmds[len(cmds)-1].want = append(cmds[len(cmds)-1].want, w)
		case strings.HasPrefix(strings.TrimSpace(l), "#"):
			// the comment of the line above, continued
		default:
			text := strings.TrimSpace(stripComment(l))
			if strings.HasSuffix(text, "\\") {
				t.Fatalf("%s: a command continued on the next line; the check runs one line at a time", where)
			}
			c := command{where: where, text: text}
			if rest, ok := strings.CutSuffix(text, "&"); ok {
				c.text, c.background = strings.TrimSpace(rest), true
			}
			cmds = append(cmds, c)
		}
	}
	return cmds
}

// stripComment removes a trailing shell comment: a # that follows white space outside quotes.
func stripComment(l string) string {
	var quote rune
	for i, r := range l {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			quote = r
		case r == '#' && (i == 0 || l[i-1] == ' ' || l[i-1] == '\t'):
			return l[:i]
		}
	}
	return l
}

// prepare builds kvmapper and the pinned nats CLI (so that no command's deadline pays for
// compiling either) and returns the binary's path and the environment every command runs with.
func prepare(t *testing.T) (string, []string) {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "kvmapper")
	errs := make(chan error, 2)
	for _, args := range [][]string{{"build", "-o", bin, "."}, {"tool", "nats", "--version"}} {
		go func() {
			cmd := exec.Command("go", args...)
			cmd.Dir = root
			out, err := cmd.CombinedOutput()
			if err != nil {
				err = fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
			}
			errs <- err
		}()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "NATS_") && !strings.HasPrefix(kv, "KVMAPPER_") {
			env = append(env, kv)
		}
	}
	return bin, env
}

// shell runs one session's commands.
type shell struct {
	t       *testing.T
	bin     string
	env     []string
	url     string // the embedded server's, once run has started
	replica *proc
	bg      []*proc
}

func newShell(t *testing.T, bin string, env []string) *shell {
	env = append(env[:len(env):len(env)],
		"KVMAPPER_LISTEN=127.0.0.1:-1",
		"KVMAPPER_DATA_DIR="+filepath.Join(t.TempDir(), "data"),
		"KVMAPPER_REPLICA_ID="+replicaID)
	sh := &shell{t: t, bin: bin, env: env}
	t.Cleanup(func() {
		for _, p := range append(sh.bg, sh.replica) {
			if p != nil {
				p.kill()
			}
		}
	})
	return sh
}

var (
	runRE      = regexp.MustCompile(`^(go run \.|kvmapper) run( |$)`)
	kvPutRE    = regexp.MustCompile(`^(go tool )?nats kv put (\S+) (\S+) `)
	readOnlyRE = regexp.MustCompile(`^((go tool )?nats (stream (get|info|ls)|kv (get|ls)|micro|req kvmapper\.status\.)|(go run \.|kvmapper) (verify|status|setup))( |$)`)
	urlRE      = regexp.MustCompile(`(nats://127\.0\.0\.1:[0-9]+)`)
)

// shellText is c as bash runs it: the kvmapper binary for `go run .` and `kvmapper`, the pinned
// nats CLI for `nats`, the replica's id for <replica-id>.
func (sh *shell) shellText(c command) string {
	text := c.text
	for _, prefix := range []string{"go run . ", "kvmapper "} {
		if rest, ok := strings.CutPrefix(text, prefix); ok {
			text = sh.bin + " " + rest
		}
	}
	if rest, ok := strings.CutPrefix(text, "nats "); ok {
		text = "go tool nats " + rest
	}
	return strings.ReplaceAll(text, "<replica-id>", replicaID)
}

func (sh *shell) do(c command) {
	t := sh.t
	t.Helper()
	switch {
	case c.text == "go test ./...":
		t.Logf("%s: %s: not run, this test is part of it", c.where, c.text)
	case runRE.MatchString(c.text):
		sh.startReplica(c)
	case c.background || strings.Contains(c.text, "--watch"):
		sh.background(c)
	default:
		sh.run(c)
	}
	if m := kvPutRE.FindStringSubmatch(c.text); m != nil {
		sh.waitTable(c, m[2], m[3])
	}
}

// startReplica starts `kvmapper run --embedded`, waits for the next steps it prints and takes
// the server's URL from its output (its log, and the next steps, name it).
func (sh *shell) startReplica(c command) {
	t := sh.t
	t.Helper()
	if sh.replica != nil {
		t.Fatalf("%s: a second kvmapper run in one session", c.where)
	}
	if !strings.Contains(c.text, "--embedded") {
		t.Fatalf("%s: %s: a session's kvmapper runs its own embedded server; start it with --embedded", c.where, c.text)
	}
	sh.replica = sh.start(c)
	sh.waitOutput(c, sh.replica, 60*time.Second, func(out string) bool { return strings.Contains(out, "In another terminal try:") })
	m := urlRE.FindStringSubmatch(sh.replica.out.String())
	if m == nil {
		t.Fatalf("%s: %s: no URL of the embedded server in its output:\n%s", c.where, c.text, sh.replica.out)
	}
	sh.url = m[1]
	sh.env = append(sh.env, "NATS_URL="+sh.url)
	sh.checkWants(c, sh.replica.out.String(), nil)
}

// background starts c and waits for its first output, or for the lines it shows when it
// refreshes in place (--watch), which it then stops as Ctrl-C would.
func (sh *shell) background(c command) {
	p := sh.start(c)
	if !strings.Contains(c.text, "--watch") {
		sh.waitOutput(c, p, 20*time.Second, func(out string) bool { return out != "" })
		sh.bg = append(sh.bg, p)
		return
	}
	sh.waitOutput(c, p, 20*time.Second, func(out string) bool { return out != "" && sh.missing(c, out, nil) == nil })
	p.interrupt()
	select {
	case <-p.done:
		sh.t.Logf("%s: %s: stopped with Ctrl-C (%v)", c.where, c.text, p.err)
	case <-time.After(10 * time.Second):
		sh.t.Fatalf("%s: %s: still running 10s after Ctrl-C", c.where, c.text)
	}
}

// run runs c in the foreground until it has printed what the page shows, or fails.
func (sh *shell) run(c command) {
	t := sh.t
	t.Helper()
	marks := make([]int, len(sh.bg))
	for i, p := range sh.bg {
		marks[i] = p.out.Len()
	}
	deadline := time.Now().Add(20 * time.Second)
	readOnly := readOnlyRE.MatchString(c.text)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := sh.command(ctx, c).CombinedOutput()
		cancel()
		var miss []string
		if err == nil {
			if miss = sh.missing(c, string(out), marks); miss == nil {
				return
			}
		}
		if !readOnly {
			if err != nil {
				t.Fatalf("%s: %s: %v\n%s", c.where, c.text, err, out)
			}
			// What it shows may still be on its way to a background command.
			for miss != nil && time.Now().Before(deadline) {
				time.Sleep(50 * time.Millisecond) // polling the background output, to the deadline
				miss = sh.missing(c, string(out), marks)
			}
			if miss != nil {
				sh.failMissing(c, miss, string(out), marks)
			}
			return
		}
		if time.Now().After(deadline) {
			if err != nil {
				t.Fatalf("%s: %s: %v\n%s", c.where, c.text, err, out)
			}
			sh.failMissing(c, miss, string(out), marks)
		}
		time.Sleep(200 * time.Millisecond) // polling a command that only reads, to the deadline
	}
}

// waitTable waits until the replica's groups table has applied the put c made of key in bucket.
func (sh *shell) waitTable(c command, bucket, key string) {
	t := sh.t
	t.Helper()
	nc, err := nats.Connect(sh.url)
	if err != nil {
		t.Fatalf("%s: connecting to %s: %v", c.where, sh.url, err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatalf("%s: bucket %s: %v", c.where, bucket, err)
	}
	e, err := kv.Get(ctx, key)
	if err != nil {
		t.Fatalf("%s: key %s of bucket %s after %s: %v", c.where, key, bucket, c.text, err)
	}
	var last error
	for ctx.Err() == nil {
		var r struct {
			Table struct {
				Revision uint64 `json:"revision"`
			} `json:"table"`
		}
		resp, err := nc.RequestWithContext(ctx, "kvmapper.status.kvmapper."+replicaID, nil)
		if err == nil {
			err = json.Unmarshal(resp.Data, &r)
		}
		if err == nil && r.Table.Revision >= e.Revision() {
			return
		}
		if err == nil {
			err = fmt.Errorf("its table is at revision %d, the put at %d", r.Table.Revision, e.Revision())
		}
		last = err
		time.Sleep(50 * time.Millisecond) // polling the replica's status, to the deadline
	}
	t.Fatalf("%s: %s: the replica's groups table did not apply it within 20s: %v", c.where, c.text, last)
}

// missing returns the lines c shows that neither out nor the background output since marks holds.
func (sh *shell) missing(c command, out string, marks []int) []string {
	var bg []string
	for i, m := range marks {
		bg = append(bg, sh.bg[i].out.String()[m:])
	}
	var miss []string
	for _, w := range c.want {
		w = strings.ReplaceAll(w, "<replica-id>", replicaID)
		var parts []string
		for _, p := range strings.Split(w, "…") {
			parts = append(parts, regexp.QuoteMeta(strings.TrimSpace(p)))
		}
		re := regexp.MustCompile(strings.Join(parts, ".*"))
		found := re.MatchString(out)
		for _, b := range bg {
			found = found || re.MatchString(b)
		}
		if !found {
			miss = append(miss, w)
		}
	}
	return miss
}

func (sh *shell) checkWants(c command, out string, marks []int) {
	if miss := sh.missing(c, out, marks); miss != nil {
		sh.failMissing(c, miss, out, marks)
	}
}

func (sh *shell) failMissing(c command, miss []string, out string, marks []int) {
	t := sh.t
	t.Helper()
	var bg strings.Builder
	for i, m := range marks {
		fmt.Fprintf(&bg, "\noutput of %s since then:\n%s", sh.bg[i].text, sh.bg[i].out.String()[m:])
	}
	t.Fatalf("%s: %s: the page shows %q, which it did not print within 20s:\n%s%s", c.where, c.text, miss, out, bg.String())
}

// waitOutput waits until p's output satisfies ok, failing when p exits first or the timeout passes.
func (sh *shell) waitOutput(c command, p *proc, timeout time.Duration, ok func(string) bool) {
	t := sh.t
	t.Helper()
	deadline := time.After(timeout)
	tick := time.NewTicker(20 * time.Millisecond) // polling p's output, to the deadline
	defer tick.Stop()
	for !ok(p.out.String()) {
		select {
		case <-p.done:
			if ok(p.out.String()) {
				return
			}
			t.Fatalf("%s: %s exited (%v) before printing what was waited for:\n%s", c.where, c.text, p.err, p.out)
		case <-deadline:
			t.Fatalf("%s: %s did not print what was waited for within %v:\n%s", c.where, c.text, timeout, p.out)
		case <-tick.C:
		}
	}
}

// stop stops the session's replica as Ctrl-C does, and requires it to exit cleanly.
func (sh *shell) stop() {
	t := sh.t
	t.Helper()
	for _, p := range sh.bg {
		p.kill()
	}
	if sh.replica == nil {
		return
	}
	sh.replica.interrupt()
	select {
	case <-sh.replica.done:
		if sh.replica.err != nil {
			t.Errorf("%s after Ctrl-C: %v\n%s", sh.replica.text, sh.replica.err, sh.replica.out)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("%s: still running 30s after Ctrl-C", sh.replica.text)
	}
}

func (sh *shell) command(ctx context.Context, c command) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "bash", "-c", sh.shellText(c))
	cmd.Dir = root
	cmd.Env = sh.env
	// Its own process group, so that stopping it stops what it started (go tool nats runs the
	// CLI as a child).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	return cmd
}

// proc is a command running in the background.
type proc struct {
	text string
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error
}

func (sh *shell) start(c command) *proc {
	p := &proc{text: c.text, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = sh.command(context.Background(), c)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		sh.t.Fatalf("%s: %s: %v", c.where, c.text, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p
}

// interrupt sends SIGINT to p's process group, as Ctrl-C at a terminal does.
func (p *proc) interrupt() { _ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGINT) }

// kill stops p's process group at once and waits for p.
func (p *proc) kill() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

// syncBuffer is a bytes.Buffer safe for a process writing while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func (b *syncBuffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Len()
}
