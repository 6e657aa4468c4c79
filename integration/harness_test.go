// Package integration holds the scenarios that span packages and processes: real kvmapper
// processes built from this module, a real embedded NATS server, the real nats CLI.
package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// bin is the kvmapper binary built once for the whole package by TestMain, with the race
// detector when the tests run with it.
var bin string

// raceReport starts what the race detector prints when it finds a data race.
const raceReport = "WARNING: DATA RACE"

// parallelScenarios is how many scenarios marked parallel run at once when `go test` is not
// told (-parallel): most of their time is spent waiting out elections, lease TTLs and slow links
// (a 3-node cluster scenario used a third of one core), so more of them than the 2 cores the
// default allows keeps the README's `go test ./...` within minutes. Under the race detector,
// whose servers are several times slower, the default stands.
const parallelScenarios = 4

func TestMain(m *testing.M) {
	flag.Parse()
	natstest.SetParallel(parallelScenarios)
	dir, err := os.MkdirTemp("", "kvmapper-integration")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "kvmapper")
	args := []string{"build", "-o", bin}
	if raceBuild {
		args = append(args, "-race")
	}
	build := exec.Command("go", append(args, "github.com/kvmapper/kvmapper")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building kvmapper:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	if code == 0 {
		// Every server, client and process a test starts is stopped by its cleanup.
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// checkRaces fails t when a kvmapper process's output holds a race detector's report. A
// process killed with SIGKILL never exits with the detector's status (66): its report, printed
// when the race happened, is the only trace.
func checkRaces(t *testing.T, id, output string) {
	t.Helper()
	if i := strings.Index(output, raceReport); i >= 0 {
		rest := output[i:]
		if len(rest) > 8<<10 {
			rest = rest[:8<<10] + "…"
		}
		t.Errorf("kvmapper %s: the race detector found a data race:\n%s", id, rest)
	}
}

// layout is the default layout every scenario uses.
func layout(t testing.TB) *subjects.Layout {
	t.Helper()
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	return lay
}

// env is one scenario's server and client.
type env struct {
	t      *testing.T
	srv    *natstest.Server
	nc     *nats.Conn
	js     jetstream.JetStream
	groups jetstream.KeyValue
	ctl    jetstream.KeyValue
	// names say how INCOMING is stored: one stream, or one per partition.
	names subjects.Names
}

func newEnv(t *testing.T) *env {
	t.Helper()
	return envOn(t, natstest.Start(t))
}

// newEnvIn is newEnv in the stream layout sl. For the partition streams the server's global
// account maps the device subjects into them, as a mappings block in its configuration would.
func newEnvIn(t *testing.T, sl subjects.StreamLayout) *env {
	t.Helper()
	srv := natstest.Start(t)
	if sl == subjects.PartitionStreams {
		lay := layout(t)
		if err := srv.GlobalAccount().AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
			t.Fatal(err)
		}
	}
	return envIn(t, srv, sl)
}

// eachLayout runs test as one subtest per stream layout, each on a server of its own.
func eachLayout(t *testing.T, test func(t *testing.T, e *env)) {
	t.Helper()
	t.Parallel() // the scenario and its layouts run beside other parallel scenarios
	for _, sl := range []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams} {
		t.Run(string(sl), func(t *testing.T) {
			t.Parallel() // each layout on a server of its own
			test(t, newEnvIn(t, sl))
		})
	}
}

// envOn is newEnv on a server the test started, with extra client options (credentials).
func envOn(t *testing.T, srv *natstest.Server, opts ...nats.Option) *env {
	t.Helper()
	return envIn(t, srv, subjects.SingleStream, opts...)
}

func envIn(t *testing.T, srv *natstest.Server, sl subjects.StreamLayout, opts ...nats.Option) *env {
	t.Helper()
	e := &env{t: t, srv: srv, names: subjects.Names{StreamLayout: sl}.WithDefaults()}
	opts = append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(20 * time.Millisecond)}, opts...)
	e.nc, e.js = srv.JetStream(t, opts...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := setup.Ensure(ctx, e.js, setup.Config{Layout: layout(t), Names: e.names}); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	var err error
	if e.groups, err = e.js.KeyValue(ctx, "device-groups"); err != nil {
		t.Fatal(err)
	}
	if e.ctl, err = e.js.KeyValue(ctx, "kvmapper"); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) put(device, group string) {
	e.t.Helper()
	if _, err := e.groups.PutString(context.Background(), device, group); err != nil {
		e.t.Fatalf("Put(%s): %v", device, err)
	}
}

// mapper is one kvmapper process.
type mapper struct {
	t    *testing.T
	id   string
	cmd  *exec.Cmd
	logs *logBuf
	done chan struct{}
	err  error // exit status, once done is closed
}

// fastFlags shrink the timings so scenarios run in seconds.
var fastFlags = []string{
	"--lease-ttl", "1s", "--renew-interval", "200ms", "--grace", "1s",
	"--checkpoint-interval", "50ms", "--publish-timeout", "2s", "--drain-timeout", "5s",
}

// flags are the flags every kvmapper command of the env needs: its server and, unless it is the
// default, its stream layout.
func (e *env) flags() []string {
	if e.names.StreamLayout == subjects.SingleStream {
		return []string{"--server", e.srv.URL()}
	}
	return []string{"--server", e.srv.URL(), "--layout", string(e.names.StreamLayout)}
}

// cli runs a kvmapper command against the env's server in its stream layout.
func (e *env) cli(command string, args ...string) (string, string, int) {
	e.t.Helper()
	return runCLI(e.t, append(append([]string{command}, e.flags()...), args...)...)
}

// incoming returns every message the streams holding INCOMING messages hold, stream by stream,
// waiting until they hold n together.
func (e *env) incoming(n int) []jetstream.Msg {
	e.t.Helper()
	names := e.names.IncomingStreams(partitions)
	natstest.Eventually(e.t, 30*time.Second, func() error {
		total := 0
		for _, s := range names {
			total += e.count(s)
		}
		if total < n {
			return fmt.Errorf("INCOMING holds %d messages, want %d", total, n)
		}
		return nil
	})
	var out []jetstream.Msg
	for _, s := range names {
		if c := e.count(s); c > 0 {
			out = append(out, e.readStream(s, c, 30*time.Second)...)
		}
	}
	return out
}

// startMapper starts `kvmapper run` against the env's server and waits until it maps.
func (e *env) startMapper(id string, extra ...string) *mapper {
	e.t.Helper()
	args := append(append([]string{"run"}, e.flags()...), "--replica-id", id, "--log-format", "json", "--log-level", "debug")
	args = append(args, fastFlags...)
	args = append(args, extra...)
	m := startProcess(e.t, id, args...)
	m.waitLog("groups table loaded", 30*time.Second)
	return m
}

func startProcess(t *testing.T, id string, args ...string) *mapper {
	t.Helper()
	m := &mapper{t: t, id: id, logs: &logBuf{}, done: make(chan struct{})}
	m.cmd = exec.Command(bin, args...)
	m.cmd.Stdout = m.logs
	m.cmd.Stderr = m.logs
	if err := m.cmd.Start(); err != nil {
		t.Fatalf("starting kvmapper: %v", err)
	}
	go func() {
		m.err = m.cmd.Wait()
		close(m.done)
	}()
	t.Cleanup(func() {
		m.kill()
		checkRaces(t, m.id, m.logs.String())
		if t.Failed() {
			t.Logf("logs of %s:\n%s", m.id, m.logs.tail(60))
		}
	})
	return m
}

// kill sends SIGKILL and waits for the process to exit.
func (m *mapper) kill() {
	_ = m.cmd.Process.Signal(syscall.SIGKILL)
	<-m.done
}

// stop sends SIGTERM and waits up to 30s for a clean exit.
func (m *mapper) stop() {
	m.t.Helper()
	m.term()
	m.waitExit()
}

// term sends SIGTERM.
func (m *mapper) term() {
	m.t.Helper()
	if err := m.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		m.t.Fatalf("SIGTERM %s: %v", m.id, err)
	}
}

// waitExit waits up to 30s for a clean exit after SIGTERM.
func (m *mapper) waitExit() {
	m.t.Helper()
	select {
	case <-m.done:
	case <-time.After(30 * time.Second):
		m.t.Fatalf("%s did not exit within 30s of SIGTERM", m.id)
	}
	if m.err != nil {
		m.t.Fatalf("%s exited with %v after SIGTERM, want exit code 0\n%s", m.id, m.err, m.logs.tail(30))
	}
}

// waitLog waits until a log line's message contains msg.
func (m *mapper) waitLog(msg string, timeout time.Duration) map[string]any {
	m.t.Helper()
	var found map[string]any
	natstest.Eventually(m.t, timeout, func() error {
		for _, l := range m.logs.lines() {
			if s, _ := l["message"].(string); strings.Contains(s, msg) {
				found = l
				return nil
			}
		}
		select {
		case <-m.done:
			return fmt.Errorf("%s exited (%v) before logging %q:\n%s", m.id, m.err, msg, m.logs.tail(20))
		default:
		}
		return fmt.Errorf("%s has not logged %q", m.id, msg)
	})
	return found
}

// stoppedStats returns the counters a mapper logs when it stops.
func (m *mapper) stoppedStats() (mapped, duplicates float64) {
	m.t.Helper()
	l := m.waitLog("replica stopped", time.Second)
	return l["mapped"].(float64), l["duplicates"].(float64)
}

// stoppedRetries returns how many messages a stopped mapper republished after a publish failure
// (a timeout, a reconnect, a server that answered nothing for the stall timeout).
func (m *mapper) stoppedRetries() float64 {
	m.t.Helper()
	return m.waitLog("replica stopped", time.Second)["retries"].(float64)
}

// logBuf collects a process's output, safe for concurrent use.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func (b *logBuf) lines() []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(b.String()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var l map[string]any
		if json.Unmarshal(sc.Bytes(), &l) == nil {
			out = append(out, l)
		}
	}
	return out
}

func (b *logBuf) tail(n int) string {
	ls := strings.Split(b.String(), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

// load publishes numbered messages for devices: payload "<device>:<n>", n counting up per device
// from where the last call for that device stopped.
type load struct {
	t    *testing.T
	js   jetstream.JetStream
	next map[string]int
}

func newLoad(t *testing.T, js jetstream.JetStream) *load {
	return &load{t: t, js: js, next: map[string]int{}}
}

// publish sends n messages to each device in turns and waits for INCOMING to acknowledge them.
func (l *load) publish(devices []string, n int) {
	l.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var futs []jetstream.PubAckFuture
	for i := 0; i < n; i++ {
		for _, d := range devices {
			m := &nats.Msg{Subject: "incoming." + d + ".evt", Data: []byte(d + ":" + strconv.Itoa(l.next[d]))}
			l.next[d]++
			fut, err := l.js.PublishMsgAsync(m)
			if err != nil {
				l.t.Fatalf("publish: %v", err)
			}
			futs = append(futs, fut)
			if len(futs) == 1000 {
				settle(l.t, ctx, futs)
				futs = futs[:0]
			}
		}
	}
	settle(l.t, ctx, futs)
}

func (l *load) total() int {
	n := 0
	for _, c := range l.next {
		n += c
	}
	return n
}

func settle(t *testing.T, ctx context.Context, futs []jetstream.PubAckFuture) {
	t.Helper()
	for _, fut := range futs {
		select {
		case <-fut.Ok():
		case err := <-fut.Err():
			t.Fatalf("publish to INCOMING: %v", err)
		case <-ctx.Done():
			t.Fatal("publishing to INCOMING did not complete")
		}
	}
}

// readStream returns every message of stream, waiting until it holds at least want.
func (e *env) readStream(stream string, want int, timeout time.Duration) []jetstream.Msg {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout+30*time.Second)
	defer cancel()
	natstest.Eventually(e.t, timeout, func() error {
		n := e.count(stream)
		if n < want {
			return fmt.Errorf("%s holds %d messages, want %d", stream, n, want)
		}
		return nil
	})
	n := e.count(stream)
	cons, err := e.js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		e.t.Fatal(err)
	}
	var out []jetstream.Msg
	for len(out) < n {
		b, err := cons.Fetch(n-len(out), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			e.t.Fatal(err)
		}
		for m := range b.Messages() {
			out = append(out, m)
		}
		if b.Error() != nil && !errors.Is(b.Error(), nats.ErrTimeout) {
			e.t.Fatal(b.Error())
		}
	}
	return out
}

// count returns how many messages stream holds. A request that fails (just after a server
// restart one may time out) is made again, for up to 10 s.
func (e *env) count(stream string) int {
	e.t.Helper()
	var n int
	natstest.Eventually(e.t, 10*time.Second, func() error {
		s, err := e.js.Stream(context.Background(), stream)
		if err != nil {
			return fmt.Errorf("reading stream %s: %w", stream, err)
		}
		info, err := s.Info(context.Background())
		if err != nil {
			return fmt.Errorf("reading stream %s: %w", stream, err)
		}
		n = int(info.State.Msgs)
		return nil
	})
	return n
}

// perDevice splits msgs by device (the payload's prefix) and checks that each device's numbers
// run 0, 1, 2… with no gap, repeat or reorder, up to want[device]. It returns the subjects each
// device's messages arrived on, in order.
func perDevice(t *testing.T, msgs []jetstream.Msg, want map[string]int) map[string][]string {
	t.Helper()
	got := map[string][]string{}
	for i, m := range msgs {
		dev, num, ok := strings.Cut(string(m.Data()), ":")
		n, err := strconv.Atoi(num)
		if !ok || err != nil {
			t.Fatalf("message %d: payload %q not from this test", i, m.Data())
		}
		if n != len(got[dev]) {
			t.Fatalf("message %d (%s): device %s message %d arrived after %d of its messages: reordered, duplicated or lost",
				i, m.Subject(), dev, n, len(got[dev]))
		}
		got[dev] = append(got[dev], m.Subject())
	}
	for d, n := range want {
		if len(got[d]) != n {
			t.Fatalf("device %s: %d messages arrived, want %d", d, len(got[d]), n)
		}
	}
	return got
}

// each says that every one of devices should have n messages, for perDevice.
func each(devices []string, n int) map[string]int {
	want := make(map[string]int, len(devices))
	for _, d := range devices {
		want[d] = n
	}
	return want
}

func deviceNames(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%03d", prefix, i)
	}
	return out
}
