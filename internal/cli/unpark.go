package cli

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func unparkCommand() *cli.Command {
	return &cli.Command{
		Name:        "unpark",
		Usage:       "release or drop a parked device's messages by hand",
		ArgsUsage:   "DEVICE...",
		Description: "The owner of each device's partition acts on it, or its next owner after a failover (docs/parking.md).",
		Flags: flags(connFlags(), layoutFlags(), in(catBehaviour,
			&cli.BoolFlag{Name: "drop", Usage: "dead-letter the parked messages (reason park-dropped) instead of releasing them"},
			&cli.DurationFlag{Name: "wait", Value: 30 * time.Second, Usage: "how long to wait for the owner to act (0: do not wait)"},
		), logFlags("info")),
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
	lay := cm.layout
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
	action := wire.UnparkRelease
	if c.Bool("drop") {
		action = wire.UnparkDrop
	}
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	nc, js, err := cm.connect(ctx, c)
	if err != nil {
		return err
	}
	defer nc.Close()
	what := "released (republished with its group, or dead-lettered as no-mapping without one)"
	if action == wire.UnparkDrop {
		what = "dead-lettered as park-dropped"
	}
	var failed error
	err = lanes.Unpark(ctx, js, lanes.UnparkConfig{Layout: lay, Names: cm.setup.Names, Action: action, Wait: wait}, devices, func(r lanes.UnparkResult) {
		switch {
		case !r.Waited:
			fmt.Fprintf(c.App.Writer, "%s: %d messages parked; asked the owner of partition %d to have them %s (%s)\n", r.Device, r.Parked, r.Partition, what, r.Key)
		case r.Err != nil:
			fmt.Fprintf(c.App.Writer, "%s: %d messages parked; the owner of partition %d has not acted within %v: %v. The request stays in %s; the partition's next owner acts on it\n",
				r.Device, r.Parked, r.Partition, wait, r.Err, r.Key)
			failed = cli.Exit("", 1)
		default:
			fmt.Fprintf(c.App.Writer, "%s: %d messages were parked; %s by the owner of partition %d\n", r.Device, r.Parked, what, r.Partition)
		}
	})
	if errors.Is(err, lanes.ErrNotParking) {
		return fmt.Errorf("there is no %s stream: nothing is parked (parking is `kvmapper run --on-unmapped park`)", cm.setup.Parked)
	}
	if err != nil {
		return err
	}
	return failed
}
