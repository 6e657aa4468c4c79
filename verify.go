package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/internal/natsconn"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func verifyCommand() *cli.Command {
	return &cli.Command{
		Name:  "verify",
		Usage: "audit OUTGOING and UNMAPPED against INCOMING: order, duplicates, gaps",
		Description: "Reads OUTGOING and UNMAPPED completely (headers only) and checks them against the range INCOMING\n" +
			"holds when it starts: every INCOMING message is in exactly one of them (no gap, no duplicate), each\n" +
			"device's messages are in INCOMING order within each stream, and no partition's epoch goes back\n" +
			"(a deposed owner's write). Messages held in PARKED (--on-unmapped park) count as parked, not\n" +
			"missing. Exits 0 when all holds, 1 with a report when not. Messages another\n" +
			"publisher wrote (no kvmapper Nats-Msg-Id) are reported as foreign but do not fail the audit.\n" +
			"In direct mode (--mode direct, or a control bucket marked so by setup) there is no INCOMING to audit\n" +
			"against: verify refuses and says what to check instead.\n\n" +
			"   Against a mapper still catching up:  kvmapper verify --wait 30s",
		Flags: flags(connFlags(), layoutFlags(), logFlags(), []cli.Flag{
			&cli.BoolFlag{Name: "json", Usage: "print the report as JSON", EnvVars: env("JSON")},
			&cli.DurationFlag{Name: "wait", Usage: "when messages are missing, keep reading the outputs this long for them to arrive", EnvVars: env("WAIT")},
			&cli.IntFlag{Name: "max-findings", Value: 20, Usage: "examples shown per kind of problem", EnvVars: env("MAX_FINDINGS")},
		}),
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
	s, err := connSettings(c)
	if err != nil {
		return err
	}
	nc, js, err := natsconn.Dial(s, "kvmapper verify", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	if err := cm.resolveLayout(ctx, js); err != nil {
		return err
	}
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
		err = printJSON(c.App.Writer, rep)
	} else {
		printReport(c.App.Writer, rep, scfg.Names)
	}
	if err != nil {
		return err
	}
	if !rep.OK() {
		return cli.Exit("", 1)
	}
	return nil
}

func rate(rep *audit.Report) float64 {
	if s := rep.Elapsed.Seconds(); s > 0 {
		return float64(rep.Outgoing+rep.Unmapped) / s
	}
	return 0
}

func printJSON(w io.Writer, rep *audit.Report) error {
	if rep.Findings == nil {
		rep.Findings = []audit.Finding{}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		OK bool `json:"ok"`
		*audit.Report
		Seconds    float64 `json:"seconds"`
		MsgsPerSec float64 `json:"msgs_per_sec"`
	}{rep.OK(), rep, rep.Elapsed.Seconds(), rate(rep)})
}

func printReport(w io.Writer, rep *audit.Report, names subjects.Names) {
	in, out, unm := names.Incoming, names.Outgoing, names.Unmapped
	// What was audited: INCOMING's range, or every partition stream's.
	audited := fmt.Sprintf("%d %s messages (seq %d..%d)", rep.Incoming, in, rep.IncomingFirst, rep.IncomingLast)
	failed := fmt.Sprintf("%s seq %d..%d (%d messages)", in, rep.IncomingFirst, rep.IncomingLast, rep.Incoming)
	if n := len(rep.Ranges); names.StreamLayout == subjects.PartitionStreams && n > 0 {
		audited = fmt.Sprintf("%d messages of the %d partition streams %s … %s", rep.Incoming, n, rep.Ranges[0].Stream, rep.Ranges[n-1].Stream)
		failed = fmt.Sprintf("the partition streams %s … %s (%d messages)", rep.Ranges[0].Stream, rep.Ranges[n-1].Stream, rep.Incoming)
		in += "-<p>"
	}
	speed := fmt.Sprintf("read %d messages in %v (%.0f msgs/s)", rep.Outgoing+rep.Unmapped, rep.Elapsed.Round(time.Millisecond), rate(rep))
	var extra string
	if rep.Foreign > 0 {
		extra += fmt.Sprintf(" %d foreign messages (no %s:<seq> Nats-Msg-Id) were not judged.", rep.Foreign, in)
	}
	if rep.Parked > 0 {
		extra += fmt.Sprintf(" %d messages are parked in %s (their devices have no group yet): held, not missing.", rep.Parked, names.Parked)
	}
	if rep.OutOfRange > 0 {
		extra += fmt.Sprintf(" %d messages name sequences outside %s's range and were checked for order only.", rep.OutOfRange, in)
	}
	if rep.OK() {
		fmt.Fprintf(w, "OK: all %s are in %s (%d) or %s (%d), once each; %s, "+
			"each in order; no stale epoch; %s.%s\n",
			audited, out, rep.Outgoing, unm, rep.Unmapped, plural(rep.Devices, "device"), speed, extra)
		return
	}
	fmt.Fprintf(w, "FAILED: %s against %s (%d read) and %s (%d read), %s; %s.%s\n",
		failed, out, rep.Outgoing, unm, rep.Unmapped, plural(rep.Devices, "device"), speed, extra)
	for _, k := range []struct {
		name string
		n    uint64
	}{
		{audit.KindMissing, rep.Missing}, {audit.KindDuplicate, rep.Duplicates}, {audit.KindReorder, rep.Reorders},
		{audit.KindStaleEpoch, rep.StaleEpochs}, {audit.KindForeign, rep.Foreign},
	} {
		fmt.Fprintf(w, "  %-12s %d\n", k.name, k.n)
	}
	if len(rep.Findings) > 0 {
		fmt.Fprintln(w, "examples:")
	}
	for _, f := range rep.Findings {
		dev := f.Device
		if dev == "" {
			dev = "-"
		}
		fmt.Fprintf(w, "  %-12s %s #%d device %s: %s\n", f.Kind, f.Stream, f.StreamSeq, dev, f.Detail)
	}
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}
