// Command kvmapper republishes NATS JetStream messages onto subjects that depend on data the
// subject does not carry: incoming.{device}.{event} becomes outgoing.{group}.{device}.{event},
// with the device→group table in a NATS KV bucket, per-device order kept, and partitions shared
// among replicas through KV leases.
//
// main.go builds the command line; the commands map flags to the packages' configurations:
// package mapper is the replica, internal/natsconn dials NATS. Only this package (through
// internal/natsconn) dials NATS or starts an embedded server.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/urfave/cli/v2"
)

// version is stamped at build time with -ldflags "-X main.version=…".
var version = "dev"

func main() {
	os.Exit(realMain(os.Args, os.Stdout, os.Stderr))
}

// usageError marks an error in what the user typed: exit code 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }

// realMain runs the command line and returns the process exit code: 0 on success, 1 when the
// command failed, 2 for a bad flag or flag value.
func realMain(args []string, stdout, stderr io.Writer) int {
	app := newApp(stdout, stderr)
	var unknown string
	app.CommandNotFound = func(_ *cli.Context, name string) { unknown = name }
	err := app.Run(args)
	if unknown != "" {
		fmt.Fprintf(stderr, "kvmapper: no command %q (see kvmapper --help)\n", unknown)
		return 2
	}
	if err == nil {
		return 0
	}
	var ue usageError
	var ee cli.ExitCoder
	switch {
	case errors.As(err, &ue):
		// The flag package names flags with one dash; kvmapper's help shows two.
		msg := strings.NewReplacer("flag --", "flag --", "defined: --", "defined: --", "flag -", "flag --", "defined: -", "defined: --").Replace(ue.err.Error())
		fmt.Fprintf(stderr, "kvmapper: %s (see kvmapper %s --help)\n", msg, commandName(args))
		return 2
	case errors.As(err, &ee):
		if msg := ee.Error(); msg != "" {
			fmt.Fprintf(stderr, "kvmapper: %s\n", msg)
		}
		return ee.ExitCode()
	default:
		fmt.Fprintf(stderr, "kvmapper: %v\n", err)
		return 1
	}
}

func commandName(args []string) string {
	for _, a := range args[1:] {
		if !strings.HasPrefix(a, "-") {
			return a
		}
	}
	return ""
}

func newApp(stdout, stderr io.Writer) *cli.App {
	onUsage := func(_ *cli.Context, err error, _ bool) error { return usageError{err} }
	app := &cli.App{
		Name:    "kvmapper",
		Usage:   "republish JetStream messages to subjects looked up in a NATS KV bucket",
		Version: versionLine(),
		Description: "Devices publish to incoming.{device}.{event}; kvmapper looks each device's group up in the\n" +
			"device-groups KV bucket and republishes the unchanged message to outgoing.{group}.{device}.{event},\n" +
			"in per-device order. Run it N times for automatic failover.",
		Writer:       stdout,
		ErrWriter:    stderr,
		OnUsageError: onUsage,
		// cli.Exit errors come back to realMain instead of exiting inside app.Run.
		ExitErrHandler:  func(*cli.Context, error) {},
		HideHelpCommand: true,
		Commands: []*cli.Command{
			runCommand(),
			setupCommand(),
			verifyCommand(),
			statusCommand(),
			replayCommand(),
			unparkCommand(),
			benchCommand(),
			serverCommand(),
		},
	}
	for _, c := range app.Commands {
		c.OnUsageError = onUsage
	}
	return app
}
