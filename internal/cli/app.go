package cli

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/urfave/cli/v2"
)

// Build is what package main was stamped with at build time.
type Build struct {
	// Version is the release, e.g. v1.2.3 ("dev" unstamped): what each replica reports.
	Version string
	// Line is what kvmapper --version prints after "kvmapper version ": the version and commit.
	Line string
}

// usageError marks an error in what the user typed: exit code 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }

// Main runs the command line args (the program's name first) of the binary b describes, writing
// to stdout and stderr, and returns the process exit code: 0 on success, 1 when the command
// failed, 2 for a bad flag or flag value. It blocks until the command is done.
func Main(args []string, stdout, stderr io.Writer, b Build) int {
	app := newApp(stdout, stderr, b)
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

func newApp(stdout, stderr io.Writer, b Build) *cli.App {
	onUsage := func(_ *cli.Context, err error, _ bool) error { return usageError{err} }
	app := &cli.App{
		Name:    "kvmapper",
		Usage:   "republish JetStream messages to subjects looked up in a NATS KV bucket",
		Version: b.Line,
		Description: "Devices publish to incoming.{device}.{event}; kvmapper republishes each message to\n" +
			"outgoing.{group}.{device}.{event}, in per-device order. Run it N times for failover (docs/).",
		Writer:       stdout,
		ErrWriter:    stderr,
		OnUsageError: onUsage,
		// cli.Exit errors come back to realMain instead of exiting inside app.Run.
		ExitErrHandler:  func(*cli.Context, error) {},
		HideHelpCommand: true,
		Commands: []*cli.Command{
			runCommand(b.Version),
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
