package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natsconn"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func runCommand() *cli.Command {
	return &cli.Command{
		Name:  "run",
		Usage: "run one replica of the mapper (start it N times for failover)",
		Description: "Creates or verifies the streams and buckets, loads the groups table, takes its share of the\n" +
			"partitions and republishes INCOMING to OUTGOING until SIGINT or SIGTERM, when it drains,\n" +
			"writes final checkpoints and hands its partitions over. With --mode direct there is no INCOMING:\n" +
			"each partition's owner republishes what devices publish as it arrives, with the device's reply\n" +
			"subject, and on SIGTERM hands each partition to its next owner without losing an acknowledgement.\n\n" +
			"   First run on a machine with only Go:  go run . run --embedded",
		Flags: flags(connFlags(), []cli.Flag{
			&cli.BoolFlag{Name: "embedded", Usage: "start an embedded NATS server with JetStream on --listen", EnvVars: env("EMBEDDED")},
			&cli.StringFlag{Name: "listen", Value: "127.0.0.1:4222", Usage: "host:port of the embedded server", EnvVars: env("LISTEN")},
			&cli.StringFlag{Name: "data-dir", Value: "kvmapper-data", Usage: "JetStream data of the embedded server", EnvVars: env("DATA_DIR")},
			&cli.StringFlag{Name: "replica-id", Usage: "this replica's name among the replicas (default: host name and a random suffix)", EnvVars: env("REPLICA_ID")},
			&cli.IntFlag{Name: "max-in-flight", Value: 4096, Usage: "publishes awaiting acknowledgement, all partitions together; each partition is guaranteed a quarter of its even share", EnvVars: env("MAX_IN_FLIGHT")},
			&cli.Int64Flag{Name: "max-in-flight-bytes", Value: 64 << 20, Usage: "bytes of publishes awaiting acknowledgement, all partitions together", EnvVars: env("MAX_IN_FLIGHT_BYTES")},
			&cli.DurationFlag{Name: "lease-ttl", Usage: "partition lease TTL, whole seconds: a replica killed outright has its partitions moved after about this (default: 2s for a control bucket on one server, 15s for a replicated one, which rides through a NATS server's death)", EnvVars: env("LEASE_TTL")},
			&cli.DurationFlag{Name: "renew-interval", Value: 500 * time.Millisecond, Usage: "how often leases are renewed (below lease-ttl)", EnvVars: env("RENEW_INTERVAL")},
			&cli.DurationFlag{Name: "grace", Value: 2 * time.Second, Usage: "any replica claims a partition unowned this long", EnvVars: env("GRACE")},
			&cli.DurationFlag{Name: "checkpoint-interval", Value: 100 * time.Millisecond, Usage: "how often each partition's progress is written", EnvVars: env("CHECKPOINT_INTERVAL")},
			&cli.DurationFlag{Name: "publish-timeout", Value: 5 * time.Second, Usage: "how long a publish waits for its acknowledgement before it is resent", EnvVars: env("PUBLISH_TIMEOUT")},
			&cli.DurationFlag{Name: "drain-timeout", Value: 10 * time.Second, Usage: "how long a stopping partition waits for its in-flight publishes", EnvVars: env("DRAIN_TIMEOUT")},
			&cli.DurationFlag{Name: "handoff-timeout", Value: 5 * time.Second, Usage: "direct mode: how long a released partition keeps forwarding while no new owner has announced itself", EnvVars: env("HANDOFF_TIMEOUT")},
			&cli.BoolFlag{Name: "direct-provenance", Usage: "direct mode: add the KVMapper-Partition, -Epoch and -Revision headers (off: they cost about a third of the throughput and can make OUTGOING refuse a message near its size limit)", EnvVars: env("DIRECT_PROVENANCE")},
			&cli.BoolFlag{Name: "no-provenance", Usage: "do not add the KVMapper-Partition, -Epoch and -Revision headers", EnvVars: env("NO_PROVENANCE")},
			&cli.StringFlag{Name: "metrics-listen", Usage: "host:port to serve Prometheus /metrics, /healthz and /readyz on, e.g. 127.0.0.1:9090 (default: off)", EnvVars: env("METRICS_LISTEN")},
			&cli.StringFlag{Name: "events-subject", Value: status.DefaultEventsSubject, Usage: "NATS subject this replica publishes its ownership changes on as JSON (empty: none)", EnvVars: env("EVENTS_SUBJECT")},
			groupsHistoryFlag(),
			&cli.DurationFlag{Name: "park-max-age", Value: 24 * time.Hour, Usage: "parked messages older than this are dead-lettered as park-expired (0: never)", EnvVars: env("PARK_MAX_AGE")},
		}, parkFlags(), layoutFlags(), logFlags()),
		Action: runAction,
	}
}

func setupCommand() *cli.Command {
	return &cli.Command{
		Name:  "setup",
		Usage: "create or verify the streams and buckets, and say what it did",
		Description: "Idempotent: creates what is missing and checks what exists. It never changes an existing\n" +
			"stream or bucket; a mismatch (say INCOMING built for another partition count) is an error naming the fix.\n" +
			"With --layout auto (the default) it gives a new deployment the partition streams when the server's\n" +
			"account mapping is active, else the single stream, and records the layout in the control bucket,\n" +
			"where every other command reads it.",
		Flags: flags(connFlags(), layoutFlags(), logFlags(), []cli.Flag{groupsHistoryFlag(),
			&cli.BoolFlag{Name: "no-balance-leaders", Usage: "leave the partition streams' leaders where JetStream elected them, instead of spreading them over the servers (--layout streams on a cluster)", EnvVars: env("NO_BALANCE_LEADERS")},
		}, parkFlags()),
		Action: func(c *cli.Context) error {
			cm, err := parseCommon(c)
			if err != nil {
				return err
			}
			scfg, log := cm.setup, cm.log
			// Only this command moves leaderships; a replica's own setup leaves them.
			scfg.BalanceLeaders = !c.Bool("no-balance-leaders")
			s, err := connSettings(c)
			if err != nil {
				return err
			}
			nc, js, err := natsconn.Dial(s, "kvmapper setup", log)
			if err != nil {
				return err
			}
			defer nc.Close()
			ctx, cancel := context.WithTimeout(c.Context, 30*time.Second)
			defer cancel()
			auto := scfg.StreamLayout == subjects.AutoLayout
			choice, err := setup.ChooseLayout(ctx, js, scfg)
			if err != nil {
				return err
			}
			scfg.StreamLayout = choice.Layout
			if auto && scfg.Mode == wire.ModeStream {
				fmt.Fprintf(c.App.Writer, "layout %s (--layout auto): %s\n", choice.Layout, choice.Why)
			}
			lines, err := setup.Ensure(ctx, js, scfg)
			for _, l := range lines {
				fmt.Fprintln(c.App.Writer, l)
			}
			if err == nil && choice.Faster != "" {
				fmt.Fprintf(c.App.Writer, "\n%s.\n\n%s", choice.Faster, setup.MappingConfig(scfg.Layout))
			}
			return err
		},
	}
}

func defaultReplicaID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "kvmapper"
	}
	host = strings.Map(func(r rune) rune {
		if r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9') {
			return r
		}
		return '-'
	}, host)
	var b [3]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

func runAction(c *cli.Context) error {
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
		id = defaultReplicaID()
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
	var srv *server.Server
	if c.Bool("embedded") {
		var url string
		srv, url, err = startEmbedded(c.String("listen"), c.String("data-dir"), mappings(scfg))
		if err != nil {
			return err
		}
		defer func() {
			srv.Shutdown()
			srv.WaitForShutdown()
		}()
		servers = url
		scfg.CallerSetsMapping = true
		log.Info().Str("url", url).Str("data_dir", c.String("data-dir")).Msg("embedded NATS server with JetStream started")
	}

	s, err := connSettings(c)
	if err != nil {
		return err
	}
	if c.Bool("embedded") {
		s.URL = servers // the embedded server's
	}
	nc, js, err := natsconn.Dial(s, "kvmapper "+id, log)
	if err != nil {
		return err
	}
	defer nc.Close()
	// Leases, heartbeats and checkpoints on a connection of their own: behind the lanes' traffic
	// they would wait their turn (mapper.Config.Control).
	cnc, cjs, err := natsconn.Dial(s, "kvmapper "+id+" control", log)
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
				waitServing(ctx, r, lay.Partitions, 15*time.Second)
				if ctx.Err() == nil {
					printNextSteps(c, servers, scfg)
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
func chooseRunLayout(ctx context.Context, js jetstream.JetStream, cfg *setup.Config, srv *server.Server, log zerolog.Logger) error {
	if cfg.Mode == wire.ModeDirect {
		// Direct mode keeps no INCOMING: nothing to choose, and nothing to log.
		c, err := setup.ChooseLayout(ctx, js, *cfg)
		cfg.StreamLayout = c.Layout
		return err
	}
	given := mappings(*cfg) != nil
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	choice, err := setup.ChooseLayout(cctx, js, *cfg)
	if err != nil {
		return err
	}
	cfg.StreamLayout = choice.Layout
	if srv != nil && !given && choice.Layout == subjects.PartitionStreams {
		if err := srv.GlobalAccount().AddMapping(cfg.Layout.MappingSource(), cfg.Layout.MappingDest()); err != nil {
			return fmt.Errorf("embedded NATS server: mapping %s → %s: %w", cfg.Layout.MappingSource(), cfg.Layout.MappingDest(), err)
		}
	}
	ev := log.Info().Str("layout", string(choice.Layout)).Str("why", choice.Why)
	if choice.Faster != "" {
		ev = ev.Str("faster", choice.Faster)
	}
	ev.Msg("stream layout")
	return nil
}

// mappings returns the account subject mappings cfg needs from the server: the partitioning
// mapping for the partition streams and for direct mode's default receive mode, none otherwise.
func mappings(cfg setup.Config) map[string]string {
	if cfg.Mode == wire.ModeDirect {
		if cfg.Receive != wire.ReceiveMapping {
			return nil
		}
	} else if cfg.StreamLayout != subjects.PartitionStreams {
		return nil
	}
	return map[string]string{cfg.Layout.MappingSource(): cfg.Layout.MappingDest()}
}

// startEmbedded starts a NATS server with JetStream listening on listen, its data in dir, whose
// global account has the subject mappings given (source → destination), as a `mappings` block in
// a server configuration file would give them.
func startEmbedded(listen, dir string, mappings map[string]string) (*server.Server, string, error) {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, "", usagef("invalid value %q for flag --listen: want host:port (%v)", listen, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < -1 || p > 65535 {
		return nil, "", usagef("invalid value %q for flag --listen: bad port", listen)
	}
	opts := &server.Options{
		ServerName: "kvmapper-embedded",
		Host:       host,
		Port:       p,
		JetStream:  true,
		StoreDir:   dir,
		NoSigs:     true,
	}
	if len(mappings) > 0 {
		// What the server does with a top-level mappings block: the global account, configured
		// before the server accepts a connection.
		gacc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
		for src, dest := range mappings {
			if err := gacc.AddMapping(src, dest); err != nil {
				return nil, "", fmt.Errorf("embedded NATS server: mapping %s → %s: %w", src, dest, err)
			}
		}
		opts.Accounts = []*server.Account{gacc}
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, "", fmt.Errorf("starting embedded NATS server: %w", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		return nil, "", fmt.Errorf("embedded NATS server did not listen on %s within 10s (is the port taken? use --listen)", listen)
	}
	return srv, srv.ClientURL(), nil
}

// waitServing waits until r serves all partitions, ctx ends or timeout passes.
func waitServing(ctx context.Context, r *mapper.Replica, partitions int, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for r.Serving() < partitions && time.Now().Before(deadline) {
		if !sleep(ctx, 20*time.Millisecond) {
			return
		}
	}
}

func printNextSteps(c *cli.Context, url string, cfg setup.Config) {
	server := ""
	if url != "nats://127.0.0.1:4222" {
		server = " -s " + url
	}
	if cfg.Mode == wire.ModeDirect {
		fmt.Fprintf(c.App.Writer, `
kvmapper is mapping %[1]s → %[2]s on %[3]s in direct mode: a device's PubAck comes from %[7]s.
In another terminal try:

  go tool nats%[4]s kv put %[5]s dev-42 group-a
  go tool nats%[4]s sub '%[6]s'
  go tool nats%[4]s pub --jetstream incoming.dev-42.temp '{"celsius": 21.5}'
  go tool nats%[4]s req incoming.dev-42.temp '{"celsius": 22.0}'

(any nats CLI works; 'go tool nats' is the one pinned in go.mod). Ctrl-C stops it cleanly.

`, cfg.Layout.In, cfg.Layout.Out, url, server, cfg.Groups, cfg.Layout.OutStreamSubject(), cfg.Outgoing)
		return
	}
	fmt.Fprintf(c.App.Writer, `
kvmapper is mapping %[1]s → %[2]s on %[3]s. In another terminal try:

  go tool nats%[4]s kv put %[5]s dev-42 group-a
  go tool nats%[4]s sub '%[6]s'
  go tool nats%[4]s pub incoming.dev-42.temp '{"celsius": 21.5}'

(any nats CLI works; 'go tool nats' is the one pinned in go.mod). Ctrl-C stops it cleanly.

`, cfg.Layout.In, cfg.Layout.Out, url, server, cfg.Groups, cfg.Layout.OutStreamSubject())
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
