package cli

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/wire"
)

func verifyCommand() *cli.Command {
	return &cli.Command{
		Name:        "verify",
		Usage:       "audit OUTGOING and UNMAPPED against INCOMING: order, duplicates, gaps",
		Description: "Exits 0 when every INCOMING message is in one output once, in order; 1 with a report (docs/verify.md).",
		Flags: flags(connFlags(), layoutFlags(), in(catBehaviour,
			&cli.BoolFlag{Name: "json", Usage: "print the report as JSON"},
			&cli.DurationFlag{Name: "wait", Usage: "when messages are missing, keep reading the outputs this long for them to arrive"},
			&cli.IntFlag{Name: "max-findings", Value: 20, Usage: "examples shown per kind of problem"},
		), logFlags("info")),
		Action: verifyAction,
	}
}

func verifyAction(c *cli.Context) error {
	cm, err := parseCommon(c)
	if err != nil {
		return err
	}
	lay, scfg, log := cm.layout, cm.setup, cm.log
	wait := c.Duration("wait")
	if wait < 0 {
		return usagef("invalid value %v for flag --wait: must not be negative", wait)
	}
	maxFindings := c.Int("max-findings")
	if maxFindings < 0 {
		return usagef("invalid value %d for flag --max-findings: must not be negative", maxFindings)
	}
	if maxFindings == 0 {
		maxFindings = -1 // audit.Config: zero means the default, negative none
	}

	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	nc, js, err := cm.connect(ctx, c)
	if err != nil {
		return err
	}
	defer nc.Close()
	scfg = cm.setup
	var lastLog time.Time
	rep, err := audit.Run(ctx, js, audit.Config{
		Layout:      lay,
		Names:       scfg.Names,
		Wait:        wait,
		MaxFindings: maxFindings,
		Direct:      scfg.Mode == wire.ModeDirect,
		Progress: func(read uint64) {
			if time.Since(lastLog) >= 2*time.Second {
				lastLog = time.Now()
				log.Info().Uint64("read", read).Msg("reading outputs")
			}
		},
	})
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("verify: %w (wrong server or stream names? kvmapper setup creates the streams; in direct mode there is no INCOMING, and nothing to verify)", err)
	}
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if c.Bool("json") {
		err = rep.WriteJSON(c.App.Writer)
	} else {
		err = rep.WriteText(c.App.Writer, scfg.Names)
	}
	if err != nil {
		return err
	}
	if !rep.OK() {
		return cli.Exit("", 1)
	}
	return nil
}
