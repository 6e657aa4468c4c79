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
			"bound), a server-side subject transform and a naive mapper (sync publish per message); end-to-end\n" +
			"latency beside publishing straight into OUTGOING; how fast a group change takes effect; the groups\n" +
			"table at 1M devices; and the gap when a replica process is killed. Ratios matter, not absolute figures.\n\n" +
			"It starts its own NATS server as a child process unless --server is given, and uses only streams and\n" +
			"buckets named BENCH_… and bench-… (it refuses a server holding others).\n\n" +
			"   Quick look:   kvmapper bench --messages 200000 --table-devices 200000 --duration 5s",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "server", Aliases: []string{"s"}, Usage: "NATS server URL to measure against (default: start one as a child process)"},
			&cli.StringFlag{Name: "data-dir", Usage: "JetStream data of the child server (default: a temporary directory, removed after)"},
			&cli.StringFlag{Name: "only", Usage: "comma-separated sub-benchmarks to run: " + strings.Join(bench.All, ",") + " (default: all)"},
			&cli.IntFlag{Name: "messages", Value: 1_000_000, Usage: "throughput: messages to map"},
			&cli.IntFlag{Name: "naive-messages", Value: 50_000, Usage: "throughput: messages the naive mapper maps (its rate is steady, and it is slow)"},
			&cli.IntFlag{Name: "devices", Value: 10_000, Usage: "devices publishing, all mapped"},
			&cli.IntFlag{Name: "payload", Value: 128, Usage: "message size in bytes"},
			&cli.IntFlag{Name: "partitions", Value: 16, Usage: "partitions of INCOMING"},
			&cli.IntFlag{Name: "replicas", Value: 1, Usage: "in-process kvmapper replicas for throughput, latency and mapping"},
			&cli.StringFlag{Name: "layout", Value: string(subjects.SingleStream), Usage: "how INCOMING is stored: single or streams (the bench's own server gets the mapping; a --server must have it)"},
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

func benchAction(c *cli.Context) error {
	log, err := logger(c, c.App.ErrWriter)
	if err != nil {
		return err
	}
	var only []string
	if s := c.String("only"); s != "" {
		for o := range strings.SplitSeq(s, ",") {
			only = append(only, strings.TrimSpace(o))
		}
	}
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	exe, err := os.Executable()
	if err != nil {
		return err
	}

	sl, err := subjects.ParseStreamLayout(c.String("layout"))
	if err != nil {
		return usagef("invalid value %q for flag --layout: use %s or %s", c.String("layout"), subjects.SingleStream, subjects.PartitionStreams)
	}
	cfg := bench.Config{
		StreamLayout:     sl,
		URL:              c.String("server"),
		Only:             only,
		Messages:         c.Int("messages"),
		NaiveMessages:    c.Int("naive-messages"),
		Devices:          c.Int("devices"),
		Payload:          c.Int("payload"),
		Partitions:       c.Int("partitions"),
		Replicas:         c.Int("replicas"),
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

	if cfg.URL == "" {
		srv, err := startServerChild(ctx, exe, c.String("data-dir"), c.String("server-cpuprofile"), sl, c.Int("partitions"))
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
	} else if c.String("server-cpuprofile") != "" {
		return usagef("--server-cpuprofile needs the bench's own server: drop --server")
	}

	rep, err := bench.Run(ctx, cfg)
	if errors.Is(err, bench.ErrInvalidConfig) {
		return usageError{err}
	}
	if rep != nil {
		if c.Bool("json") {
			enc := json.NewEncoder(c.App.Writer)
			enc.SetIndent("", "  ")
			if jerr := enc.Encode(rep); jerr != nil && err == nil {
				err = jerr
			}
		} else if werr := rep.WriteText(c.App.Writer); werr != nil && err == nil {
			err = werr
		}
	}
	return err
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
