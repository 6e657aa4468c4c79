package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/internal/natsconn"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/wire"
)

func statusCommand() *cli.Command {
	return &cli.Command{
		Name:  "status",
		Usage: "show partitions (owner, epoch, checkpoint, lag, rate), replicas and the groups bucket",
		Description: "Reads NATS only, so it works from any machine that reaches the servers: the control bucket\n" +
			"(leases, members, checkpoints), INCOMING and the groups bucket, and asks each replica for its\n" +
			"report on its status endpoint (the \"kvmapper\" NATS micro service). A partition's lag comes from\n" +
			"its owner's report, else it is counted in INCOMING after the partition's checkpoint. The rate is\n" +
			"the progress between two samples --rate-window apart (or between refreshes with --watch).\n" +
			"In direct mode (--mode direct, or a control bucket marked so by setup) there is no INCOMING: it shows\n" +
			"OUTGOING and UNMAPPED instead, and each partition's lag as its owner reports it.\n\n" +
			"   kvmapper status --watch     refresh every --interval\n" +
			"   kvmapper status --json      one JSON document (with --watch: one per line)",
		Flags: flags(connFlags(), layoutFlags(), logFlags(), []cli.Flag{
			&cli.BoolFlag{Name: "json", Usage: "print JSON instead of tables", EnvVars: env("JSON")},
			&cli.BoolFlag{Name: "watch", Aliases: []string{"w"}, Usage: "refresh in place every --interval until interrupted", EnvVars: env("WATCH")},
			&cli.DurationFlag{Name: "interval", Value: 2 * time.Second, Usage: "refresh interval of --watch", EnvVars: env("INTERVAL")},
			&cli.DurationFlag{Name: "rate-window", Value: time.Second, Usage: "without --watch: time between the two samples the rate is taken from (0: no rate)", EnvVars: env("RATE_WINDOW")},
			&cli.DurationFlag{Name: "timeout", Value: time.Second, Usage: "how long to wait for each replica's report and each stream's info", EnvVars: env("TIMEOUT")},
		}),
		Action: statusAction,
	}
}

func statusAction(c *cli.Context) error {
	cm, err := parseCommon(c)
	if err != nil {
		return err
	}
	lay, scfg, log := cm.layout, cm.setup, cm.log
	if err := positive(c, "interval"); err != nil {
		return err
	}
	if err := positive(c, "timeout"); err != nil {
		return err
	}
	window := c.Duration("rate-window")
	if window < 0 {
		return usagef("invalid value %v for flag --rate-window: must not be negative", window)
	}
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	s, err := connSettings(c)
	if err != nil {
		return err
	}
	nc, js, err := natsconn.Dial(s, "kvmapper status", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	if err := cm.resolveLayout(ctx, js); err != nil {
		return err
	}
	scfg = cm.setup
	rcfg := status.ReadConfig{
		Layout:  lay,
		Names:   scfg.Names,
		Timeout: c.Duration("timeout"),
		Direct:  scfg.Mode == wire.ModeDirect,
	}
	read := func(prev *status.Snapshot) (*status.Snapshot, error) {
		rctx, cancel := context.WithTimeout(ctx, c.Duration("timeout")+10*time.Second)
		defer cancel()
		s, err := status.Read(rctx, js, rcfg)
		if err != nil {
			return nil, err
		}
		s.SetRates(prev)
		return s, nil
	}
	out := c.App.Writer
	asJSON := c.Bool("json")

	if !c.Bool("watch") {
		s, err := read(nil)
		if err != nil {
			return err
		}
		if window > 0 {
			if !sleep(ctx, window) {
				return nil
			}
			if s, err = read(s); err != nil {
				return err
			}
		}
		return render(out, s, asJSON)
	}

	redraw := !asJSON && isTerminal(out)
	var prev *status.Snapshot
	for {
		s, err := read(prev)
		if err != nil {
			return err
		}
		if redraw {
			fmt.Fprint(out, "\033[H\033[2J")
			fmt.Fprintf(out, "kvmapper status  %s  (every %v; Ctrl-C stops)\n\n", s.At.Format(time.TimeOnly), c.Duration("interval"))
		} else if !asJSON && prev != nil {
			fmt.Fprintln(out)
		}
		if err := render(out, s, asJSON); err != nil {
			return err
		}
		prev = s
		if !sleep(ctx, c.Duration("interval")) {
			return nil
		}
	}
}

func render(w io.Writer, s *status.Snapshot, asJSON bool) error {
	if asJSON {
		b, err := json.Marshal(s)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	return s.WriteText(w)
}

// sleep waits for d and reports true, or false when ctx ends first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && isatty.IsTerminal(f.Fd())
}
