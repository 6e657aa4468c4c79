package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/embedded"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func runCommand(version string) *cli.Command {
	return &cli.Command{
		Name:  "run",
		Usage: "run one replica of the mapper (start it N times for failover)",
		Description: "Drains and hands its partitions over on SIGINT or SIGTERM (docs/flags.md#commands).\n" +
			"First run on a machine with only Go:  go run . run --embedded",
		Flags: flags(connFlags(), in(catConnection,
			&cli.BoolFlag{Name: "embedded", Usage: "start an embedded NATS server with JetStream on --listen"},
			&cli.StringFlag{Name: "listen", Value: "127.0.0.1:4222", Usage: "host:port of the embedded server"},
			&cli.StringFlag{Name: "data-dir", Value: "kvmapper-data", Usage: "JetStream data of the embedded server"},
		), layoutFlags(), in(catNames,
			&cli.StringFlag{Name: "replica-id", Usage: "this replica's name (default: host name and a random suffix)"},
			groupsHistoryFlag(),
		), parkFlags(), in(catBehaviour,
			&cli.DurationFlag{Name: "lease-ttl", Usage: "partition lease TTL, whole seconds", DefaultText: "2s, 15s on a replicated control bucket"},
			&cli.DurationFlag{Name: "renew-interval", Value: mapper.DefaultRenewInterval, Usage: "how often leases are renewed (below lease-ttl)"},
			&cli.DurationFlag{Name: "grace", Value: 2 * time.Second, Usage: "any replica claims a partition unowned this long"},
			&cli.DurationFlag{Name: "checkpoint-interval", Value: 100 * time.Millisecond, Usage: "how often each partition's progress is written"},
			&cli.DurationFlag{Name: "publish-timeout", Value: 5 * time.Second, Usage: "how long a publish waits for its acknowledgement before it is resent"},
			&cli.DurationFlag{Name: "drain-timeout", Value: 10 * time.Second, Usage: "how long a stopping partition waits for its in-flight publishes"},
			&cli.DurationFlag{Name: "handoff-timeout", Value: 5 * time.Second, Usage: "direct mode: how long a released partition forwards with no new owner"},
			&cli.BoolFlag{Name: "direct-provenance", Usage: "direct mode: add the KVMapper-Prov header (partition, epoch, revision)"},
			&cli.BoolFlag{Name: "no-provenance", Usage: "do not add the KVMapper-Prov header (partition, epoch, revision)"},
			&cli.StringFlag{Name: "metrics-listen", Usage: "host:port of Prometheus /metrics, /healthz and /readyz (default: off)"},
			&cli.StringFlag{Name: "events-subject", Value: status.DefaultEventsSubject, Usage: "subject of this replica's ownership changes, as JSON (empty: none)"},
		), in(catLimits,
			&cli.IntFlag{Name: "max-in-flight", Value: 4096, Usage: "publishes awaiting acknowledgement, all partitions together"},
			&cli.Int64Flag{Name: "max-in-flight-bytes", Value: 64 << 20, Usage: "bytes of publishes awaiting acknowledgement, all partitions together"},
			&cli.DurationFlag{Name: "park-max-age", Value: 24 * time.Hour, Usage: "parked messages older than this are dead-lettered as park-expired (0: never)"},
		), logFlags("info")),
		Action: func(c *cli.Context) error { return runAction(c, version) },
	}
}

func setupCommand() *cli.Command {
	return &cli.Command{
		Name:        "setup",
		Usage:       "create or verify the streams and buckets, and say what it did",
		Description: "Idempotent; it never changes an existing stream or bucket (docs/flags.md#commands).",
		Flags: flags(connFlags(), layoutFlags(), in(catNames, groupsHistoryFlag()), parkFlags(), in(catBehaviour,
			&cli.BoolFlag{Name: "no-balance-leaders", Usage: "leave the partition streams' leaders where JetStream elected them"},
		), logFlags("info")),
		Action: func(c *cli.Context) error {
			cm, err := parseCommon(c)
			if err != nil {
				return err
			}
			scfg, log := cm.setup, cm.log
			// Only this command moves leaderships; a replica's own setup leaves them.
			scfg.BalanceLeaders = !c.Bool("no-balance-leaders")
			nc, js, err := dial(c, "kvmapper setup", "", log)
			if err != nil {
				return err
			}
			defer nc.Close()
			ctx, cancel := context.WithTimeout(c.Context, 30*time.Second)
			defer cancel()
			return setup.Apply(ctx, js, scfg, c.App.Writer)
		},
	}
}

// runAction runs one replica that reports version.
func runAction(c *cli.Context, version string) error {
	cm, err := parseCommon(c)
	if err != nil {
		return err
	}
	lay, scfg, log := cm.layout, cm.setup, cm.log
	for _, name := range []string{"renew-interval", "grace", "checkpoint-interval", "publish-timeout", "drain-timeout", "handoff-timeout"} {
		if err := positive(c, name); err != nil {
			return err
		}
	}
	if c.IsSet("lease-ttl") {
		if err := wholeSeconds(c, "lease-ttl"); err != nil {
			return err
		}
	}
	if d := c.Duration("park-max-age"); d < 0 {
		return usagef("invalid value %v for flag --park-max-age: must not be negative (0: never)", d)
	}
	if n := c.Int("max-in-flight"); n < lay.Partitions || n > 50_000 {
		return usagef("invalid value %d for flag --max-in-flight: use %d (one per partition) to 50000 (the server refuses single messages past 100k queued)", n, lay.Partitions)
	}
	if n := c.Int64("max-in-flight-bytes"); n < 1<<20 {
		return usagef("invalid value %d for flag --max-in-flight-bytes: use at least 1048576 (1 MiB)", n)
	}
	if err := publishSubject(c, "events-subject"); err != nil {
		return err
	}
	id := c.String("replica-id")
	if id == "" {
		id = mapper.DefaultID()
	}
	if err := subjects.ValidToken(id); err != nil {
		// It names the replica's KV keys and its status subject: one subject token.
		return usagef("invalid value %q for flag --replica-id: %v", id, err)
	}
	log = log.With().Str("replica", id).Logger()

	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal starts the drain; from then on a second one ends the process at once.
	context.AfterFunc(ctx, stop)

	servers := c.String("server")
	var srv *embedded.Server
	if c.Bool("embedded") {
		srv, err = embedded.Start(embedded.Config{Listen: c.String("listen"), Dir: c.String("data-dir"), Mappings: scfg.ServerMappings()})
		if errors.Is(err, embedded.ErrInvalidListen) {
			return usagef("invalid value %q for flag --listen: %v", c.String("listen"), err)
		}
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		servers = srv.URL()
		scfg.CallerSetsMapping = true
		log.Info().Str("url", servers).Str("data_dir", c.String("data-dir")).Msg("embedded NATS server with JetStream started")
	}

	var embeddedURL string
	if srv != nil {
		embeddedURL = servers
	}
	nc, js, err := dial(c, "kvmapper "+id, embeddedURL, log)
	if err != nil {
		return err
	}
	defer nc.Close()
	// Leases, heartbeats and checkpoints on a connection of their own: behind the lanes' traffic
	// they would wait their turn (mapper.Config.Control).
	cnc, cjs, err := dial(c, "kvmapper "+id+" control", embeddedURL, log)
	if err != nil {
		return err
	}
	defer cnc.Close()
	if err := chooseRunLayout(ctx, js, &scfg, srv, log); err != nil {
		return err
	}
	r, err := mapper.New(ctx, js, mapper.Config{
		ID:      id,
		Control: cjs,
		Version: version,
		Setup:   scfg,
		Lanes: lanes.Config{
			Layout:             lay,
			Incoming:           scfg.Incoming,
			StreamLayout:       scfg.StreamLayout,
			MaxInFlight:        c.Int("max-in-flight"),
			MaxInFlightBytes:   c.Int64("max-in-flight-bytes"),
			CheckpointInterval: c.Duration("checkpoint-interval"),
			PublishTimeout:     c.Duration("publish-timeout"),
			DrainTimeout:       c.Duration("drain-timeout"),
			NoProvenance:       c.Bool("no-provenance"),
			Park:               lanes.ParkConfig{New: scfg.Park != nil, MaxAge: c.Duration("park-max-age")},
		},
		Direct: direct.Config{
			HandoffTimeout: c.Duration("handoff-timeout"),
			Provenance:     c.Bool("direct-provenance"),
		},
		Election: election.Config{
			LeaseTTL:      c.Duration("lease-ttl"),
			RenewInterval: c.Duration("renew-interval"),
			Grace:         c.Duration("grace"),
		},
		Logger:        log,
		MetricsListen: c.String("metrics-listen"),
		EventsSubject: c.String("events-subject"),
	})
	if errors.Is(err, mapper.ErrInvalidConfig) {
		return usageError{err}
	}
	if err != nil {
		return err
	}
	err = r.Run(ctx, func() {
		log.Info().Int("devices", r.Devices()).Int("partitions", lay.Partitions).
			Str("from", lay.In.String()).Str("to", lay.Out.String()).Str("unmapped", lay.Unmapped.String()).
			Msg("groups table loaded; mapping")
		if c.Bool("embedded") {
			// Once every partition is served: in direct mode a message nobody subscribes to
			// yet gets "no responders", and the first command a new user tries would fail.
			go func() {
				r.WaitServing(ctx, lay.Partitions, 15*time.Second)
				if ctx.Err() == nil {
					fmt.Fprint(c.App.Writer, scfg.NextSteps(servers))
				}
			}()
		}
	})
	st := r.Stats()
	log.Info().Uint64("mapped", st.Mapped).Interface("unmapped", st.Unmapped).Uint64("duplicates", st.Duplicates).
		Uint64("retries", st.Retries).Msg("replica stopped")
	return err
}

// chooseRunLayout resolves the stream layout of run (setup.ChooseLayout) into cfg and logs it,
// once. An embedded server (srv not nil) started without the partition streams' mapping when
// --layout was auto: it gets the mapping now if they are chosen, before setup probes it. Until
// then, for the few milliseconds since it started listening, a device's message reaches no
// stream, as during any restart.
func chooseRunLayout(ctx context.Context, js jetstream.JetStream, cfg *setup.Config, srv *embedded.Server, log zerolog.Logger) error {
	if cfg.Mode == wire.ModeDirect {
		// Direct mode keeps no INCOMING: nothing to choose, and nothing to log.
		c, err := setup.ChooseLayout(ctx, js, *cfg)
		cfg.StreamLayout = c.Layout
		return err
	}
	given := cfg.ServerMappings() != nil
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	choice, err := setup.ChooseLayout(cctx, js, *cfg)
	if err != nil {
		return err
	}
	cfg.StreamLayout = choice.Layout
	if srv != nil && !given && choice.Layout == subjects.PartitionStreams {
		if err := srv.AddMapping(cfg.Layout.MappingSource(), cfg.Layout.MappingDest()); err != nil {
			return err
		}
	}
	ev := log.Info().Str("layout", string(choice.Layout)).Str("why", choice.Why)
	if choice.Faster != "" {
		ev = ev.Str("faster", choice.Faster)
	}
	ev.Msg("stream layout")
	return nil
}

// publishSubject checks that flag name is empty or a subject one can publish to.
func publishSubject(c *cli.Context, name string) error {
	v := c.String(name)
	if v == "" {
		return nil
	}
	for tok := range strings.SplitSeq(v, ".") {
		if tok == "" || tok == "*" || tok == ">" || strings.ContainsAny(tok, " \t\r\n") {
			return usagef("invalid value %q for flag --%s: want a subject without wildcards, such as kvmapper.events.ownership", v, name)
		}
	}
	return nil
}
