package cli

import (
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/wire"
)

func statusCommand() *cli.Command {
	return &cli.Command{
		Name:        "status",
		Usage:       "show partitions (owner, epoch, checkpoint, lag, rate), replicas and the groups bucket",
		Description: "Reads NATS only, so it works from any machine that reaches the servers (docs/observe.md).",
		Flags: flags(connFlags(), layoutFlags(), in(catBehaviour,
			&cli.BoolFlag{Name: "json", Usage: "print JSON instead of tables"},
			&cli.BoolFlag{Name: "watch", Aliases: []string{"w"}, Usage: "refresh in place every --interval until interrupted"},
			&cli.DurationFlag{Name: "interval", Value: 2 * time.Second, Usage: "refresh interval of --watch"},
			&cli.DurationFlag{Name: "rate-window", Value: time.Second, Usage: "without --watch: time between the two samples the rate is taken from (0: no rate)"},
			&cli.DurationFlag{Name: "timeout", Value: time.Second, Usage: "how long to wait for each replica's report and each stream's info"},
		), logFlags("info")),
		Action: statusAction,
	}
}

func statusAction(c *cli.Context) error {
	cm, err := parseCommon(c)
	if err != nil {
		return err
	}
	lay := cm.layout
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
	nc, js, err := cm.connect(ctx, c)
	if err != nil {
		return err
	}
	defer nc.Close()
	return status.Show(ctx, js, status.ShowConfig{
		Read: status.ReadConfig{
			Layout:  lay,
			Names:   cm.setup.Names,
			Timeout: c.Duration("timeout"),
			Direct:  cm.setup.Mode == wire.ModeDirect,
		},
		JSON:       c.Bool("json"),
		Watch:      c.Bool("watch"),
		Interval:   c.Duration("interval"),
		RateWindow: window,
		Redraw:     isTerminal(c.App.Writer),
	}, c.App.Writer)
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && isatty.IsTerminal(f.Fd())
}
