package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
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
		Flags: slices.Concat(in(catConnection,
			&cli.StringFlag{Name: "server", Aliases: []string{"s"}, Usage: "NATS server URL to measure against (default: start one as a child process)"},
			&cli.StringFlag{Name: "data-dir", Usage: "JetStream data of the child server (default: a temporary directory, removed after)"},
		), in(catNames,
			&cli.StringFlag{Name: "only", Usage: "sub-benchmarks, comma-separated: " + strings.ReplaceAll(strings.Trim(fmt.Sprint(bench.All), "[]"), " ", ","), DefaultText: "all"},
			&cli.StringFlag{Name: "partitions", Value: "16", Usage: "partitions of INCOMING (a list: once each, on a server of its own)"},
			&cli.StringFlag{Name: "replicas", Value: "1", Usage: "in-process kvmapper replicas for throughput, latency and mapping (a list: once each)"},
			&cli.StringFlag{Name: "layout", Value: string(subjects.SingleStream), Usage: "how INCOMING is stored: single or streams (a list: once each)"},
			&cli.StringFlag{Name: "contenders", Usage: "contenders, comma-separated: " + strings.Join(bench.ContenderKeys(), ","), DefaultText: "all"},
			&cli.StringFlag{Name: "profile-contender", Value: "kvmapper", Usage: "the throughput contender --cpuprofile, --memprofile and --server-cpuprofile cover"},
		), in(catLimits,
			&cli.StringFlag{Name: "messages", Value: "1000000", Usage: "throughput: messages to map (a comma-separated list runs the throughput bench once for each)"},
			&cli.IntFlag{Name: "naive-messages", Value: 50_000, Usage: "throughput: messages the naive mapper maps (its rate is steady, and it is slow)"},
			&cli.IntFlag{Name: "devices", Value: 10_000, Usage: "devices publishing, all mapped"},
			&cli.IntFlag{Name: "payload", Value: 128, Usage: "message size in bytes"},
			&cli.IntFlag{Name: "rate", Value: 10_000, Usage: "latency: publish rate, msgs/s"},
			&cli.DurationFlag{Name: "duration", Value: 10 * time.Second, Usage: "latency: length of each run"},
			&cli.IntFlag{Name: "changes", Value: 200, Usage: "mapping: group changes to time"},
			&cli.IntFlag{Name: "change-load", Value: 5_000, Usage: "mapping: background load, msgs/s"},
			&cli.IntFlag{Name: "table-devices", Value: 1_000_000, Usage: "table: devices in the groups bucket"},
			&cli.IntFlag{Name: "failover-rate", Value: 2_000, Usage: "failover: publish rate, msgs/s"},
			&cli.IntFlag{Name: "failover-replicas", Value: 3, Usage: "failover: replica processes"},
		), in(catBehaviour,
			&cli.BoolFlag{Name: "json", Usage: "print the results as JSON"},
			&cli.StringFlag{Name: "cpuprofile", Usage: "write a CPU profile of the kvmapper throughput phase to this file"},
			&cli.StringFlag{Name: "memprofile", Usage: "write the kvmapper throughput phase's allocations to this file (and FILE.base)"},
			&cli.StringFlag{Name: "server-cpuprofile", Usage: "write a CPU profile of the child server during the kvmapper throughput phase to this file"},
			&cli.StringFlag{Name: "log-level", Value: "warn", Usage: "debug, info, warn or error"},
			&cli.StringFlag{Name: "log-format", Usage: "console or json (default: console on a terminal, else json)"},
		)),
		Action: benchAction,
	}
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

func parseSweep(c *cli.Context) (bench.Sweep, error) {
	var w bench.Sweep
	var err error
	if w.Messages, err = intList(c, "messages"); err != nil {
		return w, err
	}
	if w.Partitions, err = intList(c, "partitions"); err != nil {
		return w, err
	}
	if w.Replicas, err = intList(c, "replicas"); err != nil {
		return w, err
	}
	for _, l := range list(c, "layout") {
		sl, err := subjects.ParseStreamLayout(l)
		if err != nil {
			return w, usagef("invalid value %q for flag --layout: use %s or %s", l, subjects.SingleStream, subjects.PartitionStreams)
		}
		w.Layouts = append(w.Layouts, sl)
	}
	if len(w.Layouts) == 0 {
		return w, usagef("flag --layout is empty")
	}
	return w, nil
}

func benchAction(c *cli.Context) error {
	log, err := logger(c, c.App.ErrWriter)
	if err != nil {
		return err
	}
	var only []bench.Kind
	for _, k := range list(c, "only") {
		only = append(only, bench.Kind(k)) // bench.Run refuses an unknown one
	}
	var contenders []bench.ContenderName
	for _, k := range list(c, "contenders") {
		name, ok := bench.ContenderByKey(k)
		if !ok {
			return usagef("invalid value %q for flag --contenders: choose among %s", k, strings.Join(bench.ContenderKeys(), ", "))
		}
		contenders = append(contenders, name)
	}
	profile, ok := bench.ContenderByKey(c.String("profile-contender"))
	if !ok {
		return usagef("invalid value %q for flag --profile-contender: choose among %s", c.String("profile-contender"), strings.Join(bench.ContenderKeys(), ", "))
	}
	w, err := parseSweep(c)
	if err != nil {
		return err
	}
	profiling := c.String("cpuprofile") != "" || c.String("memprofile") != "" || c.String("server-cpuprofile") != ""
	if w.Runs() > 1 {
		switch {
		case len(only) > 1 || len(only) == 1 && only[0] != bench.Throughput:
			return usagef("lists in --messages, --partitions, --replicas or --layout run the throughput bench only: drop --only or give --only throughput")
		case profiling:
			return usagef("profiles cover one run: give single values to --messages, --partitions, --replicas and --layout")
		case c.String("server") != "" && (len(w.Partitions) > 1 || len(w.Layouts) > 1):
			return usagef("lists in --partitions or --layout need the bench's own server (the streams layout's mapping names the partitions): drop --server")
		}
		only = []bench.Kind{bench.Throughput}
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
		Child:            bench.ReplicaCommand(exe),
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

	srv := bench.ServerConfig{Dir: c.String("data-dir"), CPUProfile: c.String("server-cpuprofile")}
	reps, err := bench.RunSweep(ctx, cfg, w, exe, srv, func(rep *bench.Report) error {
		if c.Bool("json") {
			return nil
		}
		err := rep.WriteText(c.App.Writer)
		if w.Runs() > 1 {
			fmt.Fprintln(c.App.Writer)
		}
		return err
	})
	if c.Bool("json") && len(reps) > 0 {
		if jerr := bench.WriteJSON(c.App.Writer, reps, w.Runs() > 1); err == nil {
			err = jerr
		}
	} else if w.Runs() > 1 && len(reps) > 0 {
		if werr := bench.WriteSweep(c.App.Writer, reps); err == nil {
			err = werr
		}
	}
	if errors.Is(err, bench.ErrInvalidConfig) {
		return usageError{err}
	}
	return err
}
