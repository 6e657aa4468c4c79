package cli

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"reflect"
	"strconv"
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

// The groups --help shows the flags in.
const (
	catConnection = "connection"
	catNames      = "layout and names"
	catBehaviour  = "behaviour"
	catLimits     = "limits"
)

// in puts flags fs in the group cat of --help.
func in(cat string, fs ...cli.Flag) []cli.Flag {
	for _, f := range fs {
		reflect.ValueOf(f).Elem().FieldByName("Category").SetString(cat)
	}
	return fs
}

// flags joins the flag groups of a command and reads each flag that names no environment
// variables from KVMAPPER_<NAME> (--max-in-flight: KVMAPPER_MAX_IN_FLIGHT).
func flags(groups ...[]cli.Flag) []cli.Flag {
	var all []cli.Flag
	for _, g := range groups {
		for _, f := range g {
			if env := reflect.ValueOf(f).Elem().FieldByName("EnvVars"); env.Len() == 0 {
				env.Set(reflect.ValueOf([]string{"KVMAPPER_" + strings.ToUpper(strings.ReplaceAll(f.Names()[0], "-", "_"))}))
			}
			all = append(all, f)
		}
	}
	return all
}

// layoutFlags name the subjects, streams and buckets; every command has them.
func layoutFlags() []cli.Flag {
	return in(catNames,
		&cli.StringFlag{Name: "mode", Value: string(wire.ModeStream), Usage: "stream (devices publish into INCOMING) or direct (the owners republish what devices publish)"},
		&cli.StringFlag{Name: "layout", Value: string(subjects.AutoLayout), Usage: "how INCOMING is stored: single, streams (one stream per partition) or auto (the deployment's)"},
		&cli.StringFlag{Name: "direct-receive", Value: string(wire.ReceiveMapping), Usage: "direct mode: mapping (the server stamps the partition) or all (no server configuration)"},
		&cli.IntFlag{Name: "partitions", Value: 16, Usage: "number of partitions of INCOMING (fixed when the stream is created)"},
		&cli.StringFlag{Name: "in", Value: "incoming.{device}.{event}", Usage: "subject template devices publish to"},
		&cli.StringFlag{Name: "out", Value: "outgoing.{group}.{device}.{event}", Usage: "subject template mapped messages go to; {name} is a field of the device's value when in has none of that name"},
		&cli.StringSliceFlag{Name: "header", Usage: "an output header of mapped messages, Name={field}, e.g. Tenant={tenant} (repeat for more)"},
		&cli.StringFlag{Name: "unmapped", Value: "unmapped.{device}.{event}", Usage: "subject template dead letters go to"},
		&cli.StringFlag{Name: "incoming-stream", Value: subjects.DefaultNames.Incoming, Usage: "stream devices publish into"},
		&cli.StringFlag{Name: "outgoing-stream", Value: subjects.DefaultNames.Outgoing, Usage: "stream mapped messages go to"},
		&cli.StringFlag{Name: "unmapped-stream", Value: subjects.DefaultNames.Unmapped, Usage: "stream dead letters go to"},
		&cli.StringFlag{Name: "groups-bucket", Value: subjects.DefaultNames.Groups, Usage: "KV bucket of device id → group id"},
		&cli.StringFlag{Name: "control-bucket", Value: subjects.DefaultNames.Control, Usage: "KV bucket of leases, members and checkpoints"},
		&cli.StringFlag{Name: "parked-stream", Value: subjects.DefaultNames.Parked, Usage: "stream parked devices' messages wait in (--on-unmapped park)"},
		&cli.StringFlag{Name: "parked-prefix", Value: subjects.DefaultNames.ParkedPrefix, Usage: "first token of the parked subjects, <prefix>.<partition>.<device>"},
		&cli.IntFlag{Name: "stream-replicas", Value: 1, Usage: "replicas of the streams and buckets setup creates"},
	)
}

// groupsHistoryFlag is the flag of the commands that run setup.
func groupsHistoryFlag() cli.Flag {
	return &cli.IntFlag{Name: "groups-history", Usage: fmt.Sprintf("values per key the groups bucket keeps, 1 to %d", setup.MaxGroupsHistory),
		DefaultText: strconv.Itoa(setup.DefaultGroupsHistory)}
}

// parkFlags are the parking flags of the commands that run setup; run adds --park-max-age.
func parkFlags() []cli.Flag {
	return append(in(catBehaviour,
		&cli.StringFlag{Name: "on-unmapped", Value: string(setup.OnUnmappedDeadLetter), Usage: "a message of a device without a group is: dead-letter (to UNMAPPED) or park (in PARKED)"},
	), in(catLimits,
		&cli.Int64Flag{Name: "park-max-per-device", Value: setup.DefaultParkMaxPerDevice, Usage: "messages one device may have parked; past it: park-full"},
		&cli.Int64Flag{Name: "park-max-total", Value: setup.DefaultParkMaxTotal, Usage: "messages parked in all; past it: park-full"},
	)...)
}

// logFlags are --log-level, of default level, and --log-format.
func logFlags(level string) []cli.Flag {
	return in(catBehaviour,
		&cli.StringFlag{Name: "log-level", Value: level, Usage: "debug, info, warn or error"},
		&cli.StringFlag{Name: "log-format", Usage: "console or json (default: console on a terminal, else json)"},
	)
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
	if lay, err = lay.WithHeaders(c.StringSlice("header")); err != nil {
		return nil, usageError{fmt.Errorf("flag --header: %w", err)}
	}
	return lay, nil
}

// setupConfig maps the layout, parking and --groups-history flags onto a setup.Config with its
// defaults; a value setup.Config.Validate refuses is a usage error.
func setupConfig(c *cli.Context, lay *subjects.Layout) (setup.Config, error) {
	// Only setup and run have the parking flags; elsewhere on-unmapped reads "".
	onUnmapped, err := setup.ParseOnUnmapped(c.String("on-unmapped"))
	if err != nil {
		return setup.Config{}, usageError{err}
	}
	cfg := setup.Config{
		Mode:    wire.Mode(c.String("mode")),
		Receive: wire.Receive(c.String("direct-receive")),
		Layout:  lay,
		Names: subjects.Names{
			Incoming:     c.String("incoming-stream"),
			Outgoing:     c.String("outgoing-stream"),
			Unmapped:     c.String("unmapped-stream"),
			Groups:       c.String("groups-bucket"),
			Control:      c.String("control-bucket"),
			StreamLayout: subjects.StreamLayout(cmp.Or(c.String("layout"), string(subjects.AutoLayout))),
			Parked:       c.String("parked-stream"),
			ParkedPrefix: c.String("parked-prefix"),
		},
		Replicas: c.Int("stream-replicas"),
		// Only setup and run have the flag; elsewhere it reads 0, which checks nothing.
		GroupsHistory: c.Int("groups-history"),
	}
	if onUnmapped == setup.OnUnmappedPark {
		cfg.Park = &setup.ParkedStream{MaxPerDevice: c.Int64("park-max-per-device"), MaxTotal: c.Int64("park-max-total"),
			CheckLimits: c.IsSet("park-max-per-device") || c.IsSet("park-max-total")}
	}
	if err := cfg.Validate(); err != nil {
		return setup.Config{}, usageError{err}
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
