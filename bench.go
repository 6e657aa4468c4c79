package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/subjects"
)

func benchCommand() *cli.Command {
	return &cli.Command{
		Name:  "bench",
		Usage: "measure kvmapper against the alternatives, in one run against one NATS server",
		Description: "Runs, against the same server and data: throughput beside a server-side stream copy (the upper\n" +
			"bound), a server-side subject transform, a careful hand-written mapper (durable consumer, async publish\n" +
			"window, ack after PubAck), two relays (unfiltered ordered consumers into async publishes, or into\n" +
			"fast-ingest batches: the ceiling) and a naive mapper (sync publish per message); end-to-end\n" +
			"latency beside publishing straight into OUTGOING; how fast a group change takes effect; the groups\n" +
			"table at 1M devices; and the gap when a replica process is killed. Ratios matter, not absolute figures.\n\n" +
			"It starts its own NATS server as a child process unless --server is given, and uses only streams and\n" +
			"buckets named BENCH_… and bench-… (it refuses a server holding others).\n\n" +
			"Lists in --messages, --partitions, --replicas and --layout run the throughput bench once per\n" +
			"combination and end with a table of kvmapper against each contender in every run.\n\n" +
			"   Quick look:   kvmapper bench --messages 200000 --table-devices 200000 --duration 5s\n" +
			"   Issue 10:     kvmapper bench --messages 100000,1000000 --partitions 16,64 --replicas 1,3 --layout single,streams",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "server", Aliases: []string{"s"}, Usage: "NATS server URL to measure against (default: start one as a child process)"},
			&cli.StringFlag{Name: "data-dir", Usage: "JetStream data of the child server (default: a temporary directory, removed after)"},
			&cli.StringFlag{Name: "only", Usage: "comma-separated sub-benchmarks to run: " + strings.Join(bench.All, ",") + " (default: all)"},
			&cli.StringFlag{Name: "messages", Value: "1000000", Usage: "throughput: messages to map (a comma-separated list runs the throughput bench once for each)"},
			&cli.IntFlag{Name: "naive-messages", Value: 50_000, Usage: "throughput: messages the naive mapper maps (its rate is steady, and it is slow)"},
			&cli.IntFlag{Name: "devices", Value: 10_000, Usage: "devices publishing, all mapped"},
			&cli.IntFlag{Name: "payload", Value: 128, Usage: "message size in bytes"},
			&cli.StringFlag{Name: "partitions", Value: "16", Usage: "partitions of INCOMING (a list: once each, on a server of its own)"},
			&cli.StringFlag{Name: "replicas", Value: "1", Usage: "in-process kvmapper replicas for throughput, latency and mapping (a list: once each)"},
			&cli.StringFlag{Name: "layout", Value: string(subjects.SingleStream), Usage: "how INCOMING is stored: single or streams (the bench's own server gets the mapping; a --server must have it; a list: once each, on a server of its own)"},
			&cli.StringFlag{Name: "contenders", Usage: "comma-separated throughput contenders: " + strings.Join(contenderKeys(), ",") + " (default: all)"},
			&cli.StringFlag{Name: "profile-contender", Value: "kvmapper", Usage: "the throughput contender --cpuprofile, --memprofile and --server-cpuprofile cover"},
			&cli.IntFlag{Name: "rate", Value: 10_000, Usage: "latency: publish rate, msgs/s"},
			&cli.DurationFlag{Name: "duration", Value: 10 * time.Second, Usage: "latency: length of each run"},
			&cli.IntFlag{Name: "changes", Value: 200, Usage: "mapping: group changes to time"},
			&cli.IntFlag{Name: "change-load", Value: 5_000, Usage: "mapping: background load, msgs/s"},
			&cli.IntFlag{Name: "table-devices", Value: 1_000_000, Usage: "table: devices in the groups bucket"},
			&cli.IntFlag{Name: "failover-rate", Value: 2_000, Usage: "failover: publish rate, msgs/s"},
			&cli.IntFlag{Name: "failover-replicas", Value: 3, Usage: "failover: replica processes"},
			&cli.BoolFlag{Name: "json", Usage: "print the results as JSON"},
			&cli.StringFlag{Name: "cpuprofile", Usage: "write a CPU profile of the kvmapper throughput phase to this file"},
			&cli.StringFlag{Name: "memprofile", Usage: "write the allocation profile at the end of the kvmapper throughput phase to this file, and at its start to FILE.base (go tool pprof -base FILE.base FILE)"},
			&cli.StringFlag{Name: "server-cpuprofile", Usage: "write a CPU profile of the child server during the kvmapper throughput phase to this file"},
			&cli.StringFlag{Name: "log-level", Value: "warn", Usage: "debug, info, warn or error"},
			&cli.StringFlag{Name: "log-format", Usage: "console or json (default: console on a terminal, else json)"},
		},
		Action: benchAction,
	}
}

func contenderKeys() []string {
	var keys []string
	for _, k := range bench.Keys {
		keys = append(keys, k.Key)
	}
	return keys
}

// list splits a comma-separated flag value.
func list(c *cli.Context, name string) []string {
	var out []string
	for v := range strings.SplitSeq(c.String(name), ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// intList reads a comma-separated list of positive integers.
func intList(c *cli.Context, name string) ([]int, error) {
	var out []int
	for _, v := range list(c, name) {
		n, err := strconv.Atoi(strings.ReplaceAll(v, "_", ""))
		if err != nil || n < 1 {
			return nil, usagef("invalid value %q for flag --%s: want positive integers, comma-separated", v, name)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, usagef("flag --%s is empty", name)
	}
	return out, nil
}

// sweep is what the list flags ask for: every combination, the layouts and partition counts
// outermost (each needs a server of its own).
type sweep struct {
	messages, partitions, replicas []int
	layouts                        []subjects.StreamLayout
}

func (w sweep) runs() int {
	return len(w.messages) * len(w.partitions) * len(w.replicas) * len(w.layouts)
}

func parseSweep(c *cli.Context) (sweep, error) {
	var w sweep
	var err error
	if w.messages, err = intList(c, "messages"); err != nil {
		return w, err
	}
	if w.partitions, err = intList(c, "partitions"); err != nil {
		return w, err
	}
	if w.replicas, err = intList(c, "replicas"); err != nil {
		return w, err
	}
	for _, l := range list(c, "layout") {
		sl, err := subjects.ParseStreamLayout(l)
		if err != nil {
			return w, usagef("invalid value %q for flag --layout: use %s or %s", l, subjects.SingleStream, subjects.PartitionStreams)
		}
		w.layouts = append(w.layouts, sl)
	}
	if len(w.layouts) == 0 {
		return w, usagef("flag --layout is empty")
	}
	return w, nil
}

func benchAction(c *cli.Context) error {
	log, err := logger(c, c.App.ErrWriter)
	if err != nil {
		return err
	}
	only := list(c, "only")
	var contenders []string
	for _, k := range list(c, "contenders") {
		name, ok := bench.ContenderName(k)
		if !ok {
			return usagef("invalid value %q for flag --contenders: choose among %s", k, strings.Join(contenderKeys(), ", "))
		}
		contenders = append(contenders, name)
	}
	profile, ok := bench.ContenderName(c.String("profile-contender"))
	if !ok {
		return usagef("invalid value %q for flag --profile-contender: choose among %s", c.String("profile-contender"), strings.Join(contenderKeys(), ", "))
	}
	w, err := parseSweep(c)
	if err != nil {
		return err
	}
	profiling := c.String("cpuprofile") != "" || c.String("memprofile") != "" || c.String("server-cpuprofile") != ""
	if w.runs() > 1 {
		switch {
		case len(only) > 1 || len(only) == 1 && only[0] != bench.Throughput:
			return usagef("lists in --messages, --partitions, --replicas or --layout run the throughput bench only: drop --only or give --only throughput")
		case profiling:
			return usagef("profiles cover one run: give single values to --messages, --partitions, --replicas and --layout")
		case c.String("server") != "" && (len(w.partitions) > 1 || len(w.layouts) > 1):
			return usagef("lists in --partitions or --layout need the bench's own server (the streams layout's mapping names the partitions): drop --server")
		}
		only = []string{bench.Throughput}
	}
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	exe, err := os.Executable()
	if err != nil {
		return err
	}

	cfg := bench.Config{
		URL:              c.String("server"),
		Only:             only,
		Contenders:       contenders,
		Profile:          profile,
		NaiveMessages:    c.Int("naive-messages"),
		Devices:          c.Int("devices"),
		Payload:          c.Int("payload"),
		Rate:             c.Int("rate"),
		Duration:         c.Duration("duration"),
		Changes:          c.Int("changes"),
		ChangeLoad:       c.Int("change-load"),
		TableDevices:     c.Int("table-devices"),
		FailoverRate:     c.Int("failover-rate"),
		FailoverReplicas: c.Int("failover-replicas"),
		Child:            benchChild(exe),
		Logger:           log,
	}
	if f, ok := c.App.ErrWriter.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
		cfg.Progress = f
	}
	for name, w := range map[string]*io.Writer{"cpuprofile": &cfg.CPUProfile, "memprofile": &cfg.MemProfile} {
		if path := c.String(name); path != "" {
			f, err := os.Create(path)
			if err != nil {
				return err
			}
			defer f.Close()
			*w = f
			if name == "memprofile" {
				b, err := os.Create(path + ".base")
				if err != nil {
					return err
				}
				defer b.Close()
				cfg.MemProfileBase = b
			}
		}
	}
	if cfg.URL != "" && c.String("server-cpuprofile") != "" {
		return usagef("--server-cpuprofile needs the bench's own server: drop --server")
	}

	var reps []*bench.Report
	err = func() error {
		for _, sl := range w.layouts {
			for _, parts := range w.partitions {
				if err := benchServer(ctx, c, exe, cfg, sl, parts, w, &reps); err != nil {
					return err
				}
			}
		}
		return nil
	}()
	if c.Bool("json") && len(reps) > 0 {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		var jerr error
		if w.runs() == 1 {
			jerr = enc.Encode(reps[0])
		} else {
			jerr = enc.Encode(reps)
		}
		if err == nil {
			err = jerr
		}
	} else if w.runs() > 1 && len(reps) > 0 {
		if werr := bench.WriteSweep(c.App.Writer, reps); err == nil {
			err = werr
		}
	}
	if errors.Is(err, bench.ErrInvalidConfig) {
		return usageError{err}
	}
	return err
}

// benchServer runs the throughput bench (or everything cfg asks for) for every replica count
// and message count of w, on the layout sl with parts partitions, against the bench's own
// server (started here, stopped when done) unless cfg names one. It writes each report as
// text unless --json, and appends it to reps.
func benchServer(ctx context.Context, c *cli.Context, exe string, cfg bench.Config, sl subjects.StreamLayout, parts int, w sweep, reps *[]*bench.Report) error {
	cfg.StreamLayout, cfg.Partitions = sl, parts
	if cfg.URL == "" {
		srv, err := startServerChild(ctx, exe, c.String("data-dir"), c.String("server-cpuprofile"), sl, parts)
		if err != nil {
			return err
		}
		defer srv.stop()
		cfg.URL, cfg.ServerPID = srv.url, srv.cmd.Process.Pid
		if c.String("server-cpuprofile") != "" {
			cfg.ServerProfile = func(start bool) {
				sig := syscall.SIGUSR2
				if start {
					sig = syscall.SIGUSR1
				}
				_ = srv.cmd.Process.Signal(sig)
			}
		}
	}
	for _, r := range w.replicas {
		for _, n := range w.messages {
			run := cfg
			run.Replicas, run.Messages = r, n
			rep, err := bench.Run(ctx, run)
			if rep != nil {
				*reps = append(*reps, rep)
				if !c.Bool("json") {
					if werr := rep.WriteText(c.App.Writer); werr != nil && err == nil {
						err = werr
					}
					if w.runs() > 1 {
						fmt.Fprintln(c.App.Writer)
					}
				}
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// benchChild runs a replica as a kvmapper run process, so that the failover bench kills a real one.
func benchChild(exe string) bench.ChildFunc {
	return func(url, id string, n bench.Names) *exec.Cmd {
		return exec.Command(exe, "run", "--server", url, "--replica-id", id,
			"--partitions", strconv.Itoa(n.Partitions),
			"--incoming-stream", n.Incoming, "--outgoing-stream", n.Outgoing, "--unmapped-stream", n.Unmapped,
			"--groups-bucket", n.Groups, "--control-bucket", n.Control, "--layout", string(n.StreamLayout),
			"--log-level", "warn", "--log-format", "json")
	}
}

// serverChild is the NATS server the bench starts as kvmapper server.
type serverChild struct {
	cmd  *exec.Cmd
	url  string
	dir  string // removed on stop when the bench made it
	done chan struct{}
}

// startServerChild starts kvmapper server; in the partition-streams layout it gets the mapping
// of partitions partitions.
func startServerChild(ctx context.Context, exe, dir, cpuprofile string, sl subjects.StreamLayout, partitions int) (*serverChild, error) {
	s := &serverChild{done: make(chan struct{})}
	if dir == "" {
		d, err := os.MkdirTemp("", "kvmapper-bench-")
		if err != nil {
			return nil, err
		}
		dir, s.dir = d, d
	}
	args := []string{"server", "--listen", "127.0.0.1:-1", "--data-dir", dir, "--layout", string(sl), "--partitions", strconv.Itoa(partitions),
		"--direct-in", bench.DirectMappedIn}
	if cpuprofile != "" {
		args = append(args, "--cpuprofile", cpuprofile)
	}
	s.cmd = exec.Command(exe, args...)
	s.cmd.Stderr = os.Stderr
	out, err := s.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the NATS server: %w", err)
	}
	// The server prints its URL once it accepts connections.
	urlc := make(chan string, 1)
	go func() {
		defer close(s.done)
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			urlc <- strings.TrimSpace(sc.Text())
		}
		_, _ = io.Copy(io.Discard, out)
		_ = s.cmd.Wait()
	}()
	t := time.NewTimer(30 * time.Second)
	defer t.Stop()
	select {
	case s.url = <-urlc:
		return s, nil
	case <-s.done:
		err = errors.New("the NATS server exited before it listened")
	case <-t.C:
		err = errors.New("the NATS server did not listen within 30s")
	case <-ctx.Done():
		err = ctx.Err()
	}
	s.stop()
	return nil, err
}

// stop stops the server with SIGTERM (SIGKILL after 30s), waits for it and removes its data.
func (s *serverChild) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(30 * time.Second)
	select {
	case <-s.done:
	case <-t.C:
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	t.Stop()
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
}
