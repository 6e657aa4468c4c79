package cli

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/replay"
	"github.com/kvmapper/kvmapper/subjects"
)

func replayCommand() *cli.Command {
	return &cli.Command{
		Name:      "replay",
		Usage:     "republish a range of INCOMING through the mapping, as of any groups revision, into a stream of your choice",
		ArgsUsage: " ",
		Description: "Run again, it resumes, storing nothing twice (docs/replay.md).\n" +
			"The last two hours:  kvmapper replay --from-time 2h --into REPLAY --create",
		Flags: flags(connFlags(), layoutFlags(), in(catBehaviour,
			&cli.Uint64Flag{Name: "from-seq", Usage: "first INCOMING sequence of the range (with --layout streams: of the stream of --partition)"},
			&cli.StringFlag{Name: "from-time", Usage: "start of the range: RFC 3339 time, or a duration meaning that long ago (2h)"},
			&cli.Uint64Flag{Name: "to-seq", Usage: "last sequence of the range (default: the last message when the replay first starts)"},
			&cli.StringFlag{Name: "to-time", Usage: "end of the range, exclusive: RFC 3339 time or a duration ago"},
			&cli.StringFlag{Name: "into", Usage: "stream to publish into (required); OUTGOING only with --yes-into-outgoing"},
			&cli.BoolFlag{Name: "create", Usage: "create --into if it does not exist, capturing --out's and --dead-letters' first tokens"},
			&cli.BoolFlag{Name: "yes-into-outgoing", Usage: "confirm --into OUTGOING: its consumers receive the replayed messages besides the live ones"},
			&cli.StringFlag{Name: "dead-letters", Usage: "subject template of the replay's dead letters (default: <--out's first token>-unmapped.…)"},
			&cli.StringFlag{Name: "as-of", Value: "now", Usage: "groups table to map with: now, a groups bucket revision, or a time"},
			&cli.BoolFlag{Name: "allow-missing-history", Usage: "dead-letter (history-missing) what --as-of has no value for, instead of refusing"},
			&cli.StringFlag{Name: "devices", Usage: "only these devices, comma-separated"},
			&cli.IntSliceFlag{Name: "partition", Usage: "only these partitions (repeat or comma-separate)"},
			&cli.BoolFlag{Name: "dry-run", Usage: "map the range and print counts per group; publish and record nothing"},
			&cli.StringFlag{Name: "id", Usage: "name of the replay, its progress record and Msg-Ids (default: derived from the request)"},
			&cli.DurationFlag{Name: "publish-timeout", Value: 5 * time.Second, Usage: "how long a publish waits for its acknowledgement before it is resent"},
			&cli.DurationFlag{Name: "duplicate-window", Value: 2 * time.Minute, Usage: "duplicate window of a stream --create makes"},
			&cli.BoolFlag{Name: "no-provenance", Usage: "do not add the KVMapper-Prov and KVMapper-Replay headers"},
		), in(catLimits,
			&cli.Float64Flag{Name: "max-rate", Usage: "read at most this many messages per second (0: as fast as the target takes them)"},
			&cli.IntFlag{Name: "max-in-flight", Value: 1024, Usage: "publishes awaiting acknowledgement"},
		), logFlags("info")),
		Action: replayAction,
	}
}

func replayAction(c *cli.Context) error {
	cm, err := parseCommon(c)
	if err != nil {
		return err
	}
	names, log := cm.setup.Names, cm.log
	into := c.String("into")
	if into == "" {
		return usagef("flag --into is required: the stream to replay into")
	}
	lay, err := replayLayout(c, names, into)
	if err != nil {
		return err
	}
	now := time.Now()
	cfg := replay.Config{
		Layout:              lay,
		Names:               names,
		Into:                into,
		IntoOutgoing:        c.Bool("yes-into-outgoing"),
		Create:              c.Bool("create"),
		Replicas:            c.Int("stream-replicas"),
		DuplicateWindow:     c.Duration("duplicate-window"),
		ID:                  c.String("id"),
		FromSeq:             c.Uint64("from-seq"),
		ToSeq:               c.Uint64("to-seq"),
		Partitions:          c.IntSlice("partition"),
		AllowMissingHistory: c.Bool("allow-missing-history"),
		DryRun:              c.Bool("dry-run"),
		MaxRate:             c.Float64("max-rate"),
		MaxInFlight:         c.Int("max-in-flight"),
		PublishTimeout:      c.Duration("publish-timeout"),
		NoProvenance:        c.Bool("no-provenance"),
		Logger:              log,
	}
	for _, t := range []struct {
		flag string
		to   *time.Time
	}{{"from-time", &cfg.FromTime}, {"to-time", &cfg.ToTime}} {
		if v := c.String(t.flag); v != "" {
			if *t.to, err = replay.ParseWhen(v, now); err != nil {
				return usagef("invalid value %q for flag --%s: %v", v, t.flag, err)
			}
		}
	}
	if cfg.AsOf, err = replay.ParseAsOf(c.String("as-of"), now); err != nil {
		return usagef("invalid value %q for flag --as-of: %v", c.String("as-of"), err)
	}
	if v := c.String("devices"); v != "" {
		cfg.Devices = strings.Split(v, ",")
	}
	if err := positive(c, "publish-timeout"); err != nil {
		return err
	}
	if err := positive(c, "duplicate-window"); err != nil {
		return err
	}
	out := c.App.Writer
	terminal := isTerminal(out)
	meter := replay.NewMeter(out, terminal)
	cfg.Progress = meter.Report
	if terminal {
		cfg.ReportInterval = 200 * time.Millisecond
	}
	if err := cfg.Validate(); err != nil {
		return usageError{err}
	}
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	nc, js, err := cm.connect(ctx, c)
	if err != nil {
		return err
	}
	defer nc.Close()
	cfg.Names = cm.setup.Names
	r, err := replay.New(js, cfg)
	if err != nil {
		return usageError{err}
	}
	if err := r.Run(ctx); err != nil {
		return err
	}
	if err := meter.Err(); err != nil {
		return err
	}
	if sum := r.Summary(); !sum.Complete {
		return cli.Exit(fmt.Sprintf("replay %s stopped before the end of its range; run it again with --id %s to resume", sum.ID, sum.ID), 1)
	}
	return nil
}

// replayLayout builds the replay's templates: --in and --partitions as the live mapper's; --out
// and --dead-letters its own (replay.Templates).
func replayLayout(c *cli.Context, names subjects.Names, into string) (*subjects.Layout, error) {
	live, err := layout(c)
	if err != nil {
		return nil, err
	}
	given := ""
	if c.IsSet("out") {
		given = c.String("out")
	}
	out, dead, err := replay.Templates(live, names.Outgoing, into, given, c.String("dead-letters"))
	if err != nil {
		return nil, usagef("invalid value %q for flag --out: %v", given, err)
	}
	lay, err := subjects.NewLayout(c.String("in"), out, dead, c.Int("partitions"))
	if err != nil {
		return nil, usageError{err}
	}
	if lay, err = lay.WithHeaders(live.Headers()); err != nil {
		return nil, usageError{err}
	}
	return lay, nil
}
