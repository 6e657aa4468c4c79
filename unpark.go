package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/internal/natsconn"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func unparkCommand() *cli.Command {
	return &cli.Command{
		Name:      "unpark",
		Usage:     "release or drop a parked device's messages by hand",
		ArgsUsage: "DEVICE...",
		Description: "Asks the owner of each device's partition, through the key unpark.<partition>.<device> in the\n" +
			"control bucket, to empty the device's park now: each parked message is republished with the\n" +
			"device's group, or dead-lettered to UNMAPPED with reason no-mapping when it has none; with --drop\n" +
			"every one is dead-lettered with reason park-dropped. The owner deletes the key once done; the\n" +
			"request survives a failover (the partition's next owner acts on it). Without a group, the\n" +
			"device's next message is parked again: give it a group to stop parking it.\n\n" +
			"   kvmapper unpark dev-42            release dev-42's parked messages now\n" +
			"   kvmapper unpark --drop dev-42     dead-letter them",
		Flags: flags(connFlags(), layoutFlags(), logFlags(), []cli.Flag{
			&cli.BoolFlag{Name: "drop", Usage: "dead-letter the parked messages (reason park-dropped) instead of releasing them", EnvVars: env("DROP")},
			&cli.DurationFlag{Name: "wait", Value: 30 * time.Second, Usage: "how long to wait for the owner to act (0: do not wait)", EnvVars: env("WAIT")},
		}),
		Action: unparkAction,
	}
}

// kvKey is what nats.go accepts as a KV key.
var kvKey = regexp.MustCompile(`^[-/_=\.a-zA-Z0-9]+$`)

func unparkAction(c *cli.Context) error {
	cm, err := parseCommon(c)
	if err != nil {
		return err
	}
	lay, scfg, log := cm.layout, cm.setup, cm.log
	devices := c.Args().Slice()
	if len(devices) == 0 {
		return usagef("kvmapper unpark needs at least one DEVICE")
	}
	for _, d := range devices {
		if err := subjects.ValidToken(d); err != nil || !kvKey.MatchString(d) {
			return usagef("invalid device %q: a device id is one subject token that is also a KV key (letters, digits, -, _, =, /)", d)
		}
	}
	wait := c.Duration("wait")
	if wait < 0 {
		return usagef("invalid value %v for flag --wait: must not be negative", wait)
	}
	value := wire.UnparkRelease
	if c.Bool("drop") {
		value = wire.UnparkDrop
	}
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	s, err := connSettings(c)
	if err != nil {
		return err
	}
	nc, js, err := natsconn.Dial(s, "kvmapper unpark", log)
	if err != nil {
		return err
	}
	defer nc.Close()
	if err := cm.resolveLayout(ctx, js); err != nil {
		return err
	}
	scfg = cm.setup
	ps, err := js.Stream(ctx, scfg.Parked)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("there is no %s stream: nothing is parked (parking is `kvmapper run --on-unmapped park`)", scfg.Parked)
	}
	if err != nil {
		return fmt.Errorf("opening stream %s: %w", scfg.Parked, err)
	}
	ctl, err := js.KeyValue(ctx, scfg.Control)
	if err != nil {
		return fmt.Errorf("opening bucket %s: %w", scfg.Control, err)
	}
	var failed error
	for _, d := range devices {
		p := subjects.Partition(d, lay.Partitions)
		subj := subjects.ParkedSubject(scfg.ParkedPrefix, p, d)
		info, err := ps.Info(ctx, jetstream.WithSubjectFilter(subj))
		if err != nil {
			return fmt.Errorf("reading stream %s: %w", scfg.Parked, err)
		}
		n := info.State.Subjects[subj]
		key := wire.UnparkKey(p, d)
		rev, err := ctl.PutString(ctx, key, string(value))
		if err != nil {
			return fmt.Errorf("writing %s to bucket %s: %w", key, scfg.Control, err)
		}
		what := "released (republished with its group, or dead-lettered as no-mapping without one)"
		if value == wire.UnparkDrop {
			what = "dead-lettered as park-dropped"
		}
		if wait == 0 {
			fmt.Fprintf(c.App.Writer, "%s: %d messages parked; asked the owner of partition %d to have them %s (%s)\n", d, n, p, what, key)
			continue
		}
		if err := waitDeleted(ctx, ctl, key, rev, wait); err != nil {
			fmt.Fprintf(c.App.Writer, "%s: %d messages parked; the owner of partition %d has not acted within %v: %v. The request stays in %s; the partition's next owner acts on it\n",
				d, n, p, wait, err, key)
			failed = cli.Exit("", 1)
			continue
		}
		fmt.Fprintf(c.App.Writer, "%s: %d messages were parked; %s by the owner of partition %d\n", d, n, what, p)
	}
	return failed
}

// waitDeleted waits until key, put at revision rev, is deleted (the owner acted on it).
func waitDeleted(ctx context.Context, ctl jetstream.KeyValue, key string, rev uint64, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	w, err := ctl.Watch(ctx, key)
	if err != nil {
		return err
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return errors.New("the watch ended")
			}
			if e != nil && e.Revision() > rev && e.Operation() != jetstream.KeyValuePut {
				return nil
			}
			if e != nil && e.Revision() > rev {
				return errors.New("someone wrote the key again")
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
