package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func env(name string) []string { return []string{"KVMAPPER_" + name} }

// layoutFlags name the subjects, streams and buckets; every command has them.
func layoutFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "layout", Value: string(subjects.AutoLayout), Usage: "how INCOMING is stored: single (one stream partitioned by its subject transform; works on any server), " +
			"streams (one stream per partition, <incoming-stream>-<p>, filled by an account subject mapping the server must have: setup checks it and prints it, run --embedded sets it; faster) or " +
			"auto (the deployment's, recorded in the control bucket by setup; a new one gets streams when the server has the mapping or with run --embedded, else single)", EnvVars: env("LAYOUT")},
		&cli.IntFlag{Name: "partitions", Value: 16, Usage: "number of partitions of INCOMING (fixed when the stream is created)", EnvVars: env("PARTITIONS")},
		&cli.StringFlag{Name: "in", Value: "incoming.{device}.{event}", Usage: "subject template devices publish to", EnvVars: env("IN")},
		&cli.StringFlag{Name: "out", Value: "outgoing.{group}.{device}.{event}", Usage: "subject template mapped messages go to", EnvVars: env("OUT")},
		&cli.StringFlag{Name: "unmapped", Value: "unmapped.{device}.{event}", Usage: "subject template dead letters go to", EnvVars: env("UNMAPPED")},
		&cli.StringFlag{Name: "incoming-stream", Value: subjects.DefaultNames.Incoming, Usage: "stream devices publish into", EnvVars: env("INCOMING_STREAM")},
		&cli.StringFlag{Name: "outgoing-stream", Value: subjects.DefaultNames.Outgoing, Usage: "stream mapped messages go to", EnvVars: env("OUTGOING_STREAM")},
		&cli.StringFlag{Name: "unmapped-stream", Value: subjects.DefaultNames.Unmapped, Usage: "stream dead letters go to", EnvVars: env("UNMAPPED_STREAM")},
		&cli.StringFlag{Name: "groups-bucket", Value: subjects.DefaultNames.Groups, Usage: "KV bucket of device id → group id", EnvVars: env("GROUPS_BUCKET")},
		&cli.StringFlag{Name: "control-bucket", Value: subjects.DefaultNames.Control, Usage: "KV bucket of leases, members and checkpoints", EnvVars: env("CONTROL_BUCKET")},
		&cli.StringFlag{Name: "parked-stream", Value: subjects.DefaultNames.Parked, Usage: "stream parked devices' messages wait in (--on-unmapped park)", EnvVars: env("PARKED_STREAM")},
		&cli.StringFlag{Name: "parked-prefix", Value: subjects.DefaultNames.ParkedPrefix, Usage: "first token of the parked subjects, <prefix>.<partition>.<device>", EnvVars: env("PARKED_PREFIX")},
		&cli.IntFlag{Name: "stream-replicas", Value: 1, Usage: "replicas of the streams and buckets setup creates", EnvVars: env("STREAM_REPLICAS")},
		&cli.StringFlag{Name: "mode", Value: string(wire.ModeStream), Usage: "stream (devices publish into INCOMING, which the replicas map) or " +
			"direct (no INCOMING: each partition's owner receives what devices publish over core NATS and republishes it with the device's reply subject, so the device's PubAck comes from OUTGOING)", EnvVars: env("MODE")},
		&cli.StringFlag{Name: "direct-receive", Value: string(wire.ReceiveMapping), Usage: "direct mode: mapping (the server's account mapping stamps the partition; each owner subscribes to its partitions: setup checks it and prints it, run --embedded sets it) or " +
			"all (no server configuration: every replica subscribes to every device subject and keeps its partitions)", EnvVars: env("DIRECT_RECEIVE")},
	}
}

// groupsHistoryFlag is the flag of the commands that run setup.
func groupsHistoryFlag() cli.Flag {
	return &cli.IntFlag{Name: "groups-history", Usage: fmt.Sprintf("values per key the groups bucket keeps when setup creates it, 1 to %d: how far back replay --as-of maps every device "+
		"(default %d; when given, an existing bucket keeping fewer is an error)", setup.MaxGroupsHistory, setup.DefaultGroupsHistory), EnvVars: env("GROUPS_HISTORY")}
}

// On-unmapped modes: what `run` does with a message of a device that has no group.
const (
	onUnmappedDeadLetter = "dead-letter"
	onUnmappedPark       = "park"
)

// parkFlags are the parking flags of the commands that run setup; run adds --park-max-age.
func parkFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "on-unmapped", Value: onUnmappedDeadLetter, Usage: "what a message of a device without a group becomes: dead-letter (to UNMAPPED, reason no-mapping) or " +
			"park (held in the PARKED stream, with every later message of the device behind it, until the device gets a group; setup creates PARKED)", EnvVars: env("ON_UNMAPPED")},
		&cli.Int64Flag{Name: "park-max-per-device", Value: setup.DefaultParkMaxPerDevice, Usage: "messages one device may have parked; past it they are dead-lettered as park-full " +
			"(PARKED's max_msgs_per_subject; when given, an existing PARKED with another limit is an error)", EnvVars: env("PARK_MAX_PER_DEVICE")},
		&cli.Int64Flag{Name: "park-max-total", Value: setup.DefaultParkMaxTotal, Usage: "messages parked in all; past it they are dead-lettered as park-full (PARKED's max_msgs)", EnvVars: env("PARK_MAX_TOTAL")},
	}
}

func logFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "log-level", Value: "info", Usage: "debug, info, warn or error", EnvVars: env("LOG_LEVEL")},
		&cli.StringFlag{Name: "log-format", Usage: "console or json (default: console on a terminal, else json)", EnvVars: env("LOG_FORMAT")},
	}
}

func flags(groups ...[]cli.Flag) []cli.Flag {
	var all []cli.Flag
	for _, g := range groups {
		all = append(all, g...)
	}
	return all
}

// common is what every command builds from its flags before anything else.
type common struct {
	layout *subjects.Layout
	setup  setup.Config
	log    zerolog.Logger
}

// parseCommon reads the layout, setup and log flags; an invalid one is a usage error.
func parseCommon(c *cli.Context) (common, error) {
	lay, err := layout(c)
	if err != nil {
		return common{}, err
	}
	scfg, err := setupConfig(c, lay)
	if err != nil {
		return common{}, err
	}
	log, err := logger(c, c.App.ErrWriter)
	if err != nil {
		return common{}, err
	}
	return common{layout: lay, setup: scfg, log: log}, nil
}

// resolveLayout replaces --layout auto with the deployment's stream layout, for the commands
// that use a deployment setup made: the layout the control bucket records, else the one whose
// INCOMING streams exist (setup.RecordedLayout). An explicit --layout the record contradicts is
// refused, and so is auto when nothing tells. It blocks for a few round trips.
func (cm *common) resolveLayout(ctx context.Context, js jetstream.JetStream) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	choice, err := setup.RecordedLayout(ctx, js, cm.setup)
	if err != nil {
		return err
	}
	cm.setup.StreamLayout = choice.Layout
	return nil
}

// layout builds the subject layout from the flags; a bad template is a usage error.
func layout(c *cli.Context) (*subjects.Layout, error) {
	lay, err := subjects.NewLayout(c.String("in"), c.String("out"), c.String("unmapped"), c.Int("partitions"))
	if err != nil {
		return nil, usageError{err}
	}
	return lay, nil
}

func setupConfig(c *cli.Context, lay *subjects.Layout) (setup.Config, error) {
	if r := c.Int("stream-replicas"); r < 1 || r > 5 {
		return setup.Config{}, usagef("invalid value %d for flag --stream-replicas: must be 1 to 5", r)
	}
	sl := subjects.AutoLayout
	if v := c.String("layout"); v != string(subjects.AutoLayout) && v != "" {
		var err error
		if sl, err = subjects.ParseStreamLayout(v); err != nil {
			return setup.Config{}, usagef("invalid value %q for flag --layout: use %s, %s or %s", v, subjects.AutoLayout, subjects.SingleStream, subjects.PartitionStreams)
		}
	}
	mode, err := wire.ParseMode(c.String("mode"))
	if err != nil {
		return setup.Config{}, usagef("invalid value %q for flag --mode: use %s or %s", c.String("mode"), wire.ModeStream, wire.ModeDirect)
	}
	receive, err := wire.ParseReceive(c.String("direct-receive"))
	if err != nil {
		return setup.Config{}, usagef("invalid value %q for flag --direct-receive: use %s or %s", c.String("direct-receive"), wire.ReceiveMapping, wire.ReceiveAll)
	}
	cfg := setup.Config{
		Mode:    mode,
		Receive: receive,
		Layout:  lay,
		Names: subjects.Names{
			Incoming:     c.String("incoming-stream"),
			Outgoing:     c.String("outgoing-stream"),
			Unmapped:     c.String("unmapped-stream"),
			Groups:       c.String("groups-bucket"),
			Control:      c.String("control-bucket"),
			StreamLayout: sl,
			Parked:       c.String("parked-stream"),
			ParkedPrefix: c.String("parked-prefix"),
		},
		Replicas: c.Int("stream-replicas"),
		// Only setup and run have the flag; elsewhere it reads 0, which checks nothing.
		GroupsHistory: c.Int("groups-history"),
	}
	if h := cfg.GroupsHistory; h < 0 || h > setup.MaxGroupsHistory {
		return setup.Config{}, usagef("invalid value %d for flag --groups-history: a bucket keeps 1 to %d values per key", h, setup.MaxGroupsHistory)
	}
	for _, name := range []string{"parked-stream", "parked-prefix"} {
		if v := c.String(name); strings.ContainsAny(v, " \t\r\n*>") || strings.HasPrefix(v, ".") || strings.HasSuffix(v, ".") || strings.Contains(v, "..") {
			return setup.Config{}, usagef("invalid value %q for flag --%s: want a name without white space, wildcards or empty tokens", v, name)
		}
	}
	// Only setup and run have the parking flags; elsewhere on-unmapped reads "".
	switch mode := c.String("on-unmapped"); mode {
	case "", onUnmappedDeadLetter:
	case onUnmappedPark:
		if cfg.Mode == wire.ModeDirect {
			return setup.Config{}, usagef("--on-unmapped park needs --mode stream: in direct mode no stream holds a device's messages, so nothing can keep the parked ones in order")
		}
		per, total := c.Int64("park-max-per-device"), c.Int64("park-max-total")
		if per < 1 {
			return setup.Config{}, usagef("invalid value %d for flag --park-max-per-device: at least 1", per)
		}
		if total < per {
			return setup.Config{}, usagef("invalid value %d for flag --park-max-total: at least --park-max-per-device (%d)", total, per)
		}
		cfg.Park = &setup.ParkConfig{MaxPerDevice: per, MaxTotal: total,
			CheckLimits: c.IsSet("park-max-per-device") || c.IsSet("park-max-total")}
	default:
		return setup.Config{}, usagef("invalid value %q for flag --on-unmapped: use %s or %s", mode, onUnmappedDeadLetter, onUnmappedPark)
	}
	cfg.Defaults()
	return cfg, nil
}

// logger builds the process logger from --log-level and --log-format.
func logger(c *cli.Context, w io.Writer) (zerolog.Logger, error) {
	lvl, err := zerolog.ParseLevel(strings.ToLower(c.String("log-level")))
	if err != nil || lvl == zerolog.NoLevel {
		return zerolog.Nop(), usagef("invalid value %q for flag --log-level: use debug, info, warn or error", c.String("log-level"))
	}
	format := c.String("log-format")
	if format == "" {
		format = "json"
		if f, ok := w.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
			format = "console"
		}
	}
	switch format {
	case "json":
	case "console":
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: time.TimeOnly}
	default:
		return zerolog.Nop(), usagef("invalid value %q for flag --log-format: use console or json", format)
	}
	return zerolog.New(w).Level(lvl).With().Timestamp().Logger(), nil
}

func positive(c *cli.Context, name string) error {
	if d := c.Duration(name); d <= 0 {
		return usagef("invalid value %v for flag --%s: must be positive", d, name)
	}
	return nil
}

func wholeSeconds(c *cli.Context, name string) error {
	d := c.Duration(name)
	if d < time.Second || d%time.Second != 0 {
		return usagef("invalid value %v for flag --%s: the server takes whole seconds, at least 1s", d, name)
	}
	return nil
}
