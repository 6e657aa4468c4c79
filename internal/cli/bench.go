package cli

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/subjects"
)

func benchCommand() *cli.Command {
	return &cli.Command{
		Name:  "bench",
		Usage: "measure kvmapper against the alternatives, in one run against one NATS server",
		Description: "Starts its own NATS server unless --server is given (docs/performance.md).\n" +
			"Quick look:  kvmapper bench --messages 200000 --table-devices 200000 --duration 5s",
		Flags: slices.Concat(in(catConnection,
			&cli.StringFlag{Name: "server", Aliases: []string{"s"}, Usage: "NATS server URL to measure against (default: start one as a child process)"},
			&cli.StringFlag{Name: "data-dir", Usage: "JetStream data of the child server (default: a temporary directory, removed after)"},
			&cli.IntFlag{Name: "cluster", Usage: "run throughput on this many child servers in one cluster, streams at R3 (3: the production default)"},
			&cli.IntFlag{Name: "stream-replicas", Usage: "with --server: the replicas of the streams and buckets the bench creates (its own --cluster sets them)", DefaultText: "1"},
		), in(catNames,
			&cli.StringFlag{Name: "only", Usage: "sub-benchmarks, comma-separated: " + strings.ReplaceAll(strings.Trim(fmt.Sprint(bench.All), "[]"), " ", ","), DefaultText: "all"},
			&cli.StringFlag{Name: "partitions", Value: "16", Usage: "partitions of INCOMING (a list: once each, on a server of its own)"},
			&cli.StringFlag{Name: "replicas", Value: "1", Usage: "in-process kvmapper replicas for throughput, latency and mapping (a list: once each)"},
			&cli.StringFlag{Name: "layout", Value: string(subjects.SingleStream), Usage: "how INCOMING is stored: single or streams (a list: once each)"},
			&cli.StringFlag{Name: "contenders", Usage: "comma-separated: " + strings.Join(bench.ContenderKeys(), ","), DefaultText: "all"},
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
		), logFlags("warn")),
		Action: benchAction,
	}
}

func benchAction(c *cli.Context) error {
	log, err := logger(c, c.App.ErrWriter)
	if err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cfg := bench.Config{
		URL:              c.String("server"),
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
		StreamReplicas:   c.Int("stream-replicas"),
	}
	srv := bench.ServerConfig{Dir: c.String("data-dir"), CPUProfile: c.String("server-cpuprofile"), Nodes: c.Int("cluster")}
	w, err := benchConfig(c, &cfg, srv)
	if err != nil {
		return usageError{err}
	}
	if isTerminal(c.App.ErrWriter) {
		cfg.Progress = c.App.ErrWriter
	}
	closeProfiles, err := cfg.CreateProfiles(c.String("cpuprofile"), c.String("memprofile"))
	if err != nil {
		return err
	}
	defer closeProfiles()
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
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

// benchConfig maps the list flags of bench onto cfg and returns the sweep they ask for.
func benchConfig(c *cli.Context, cfg *bench.Config, srv bench.ServerConfig) (bench.Sweep, error) {
	for _, k := range bench.List(c.String("only")) {
		cfg.Only = append(cfg.Only, bench.Kind(k)) // bench.Run refuses an unknown one
	}
	for _, k := range bench.List(c.String("contenders")) {
		name, err := bench.ParseContender("contenders", k)
		if err != nil {
			return bench.Sweep{}, err
		}
		cfg.Contenders = append(cfg.Contenders, name)
	}
	var err error
	if cfg.Profile, err = bench.ParseContender("profile-contender", c.String("profile-contender")); err != nil {
		return bench.Sweep{}, err
	}
	w, err := bench.ParseSweep(c.String("messages"), c.String("partitions"), c.String("replicas"), c.String("layout"))
	if err != nil {
		return w, err
	}
	profiling := c.String("cpuprofile") != "" || c.String("memprofile") != "" || srv.CPUProfile != ""
	return w, w.Fit(cfg, srv, profiling)
}
