package main

import (
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// serverCommand runs only an embedded NATS server with JetStream: kvmapper bench starts one as a
// child process, so that the server's CPU is its own and the bench can read it.
func serverCommand() *cli.Command {
	return &cli.Command{
		Name:   "server",
		Usage:  "run only an embedded NATS server with JetStream until SIGINT or SIGTERM",
		Hidden: true,
		Description: "The server kvmapper bench starts for itself. With --cpuprofile, SIGUSR1 starts a CPU profile\n" +
			"of the server and SIGUSR2 writes it.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "listen", Value: "127.0.0.1:4222", Usage: "host:port to listen on"},
			&cli.StringFlag{Name: "data-dir", Value: "kvmapper-data", Usage: "JetStream data directory"},
			&cli.StringFlag{Name: "cpuprofile", Usage: "file for a CPU profile taken between SIGUSR1 and SIGUSR2"},
			&cli.StringFlag{Name: "layout", Value: string(subjects.SingleStream), Usage: "streams: give the server the account mapping of the partition-streams layout"},
			&cli.IntFlag{Name: "partitions", Value: 16, Usage: "partitions of that mapping"},
			&cli.StringFlag{Name: "in", Value: "incoming.{device}.{event}", Usage: "subject template of that mapping"},
			&cli.StringFlag{Name: "direct-in", Usage: "also map this subject template into partitions, as direct mode's mapping receive mode needs (the bench's direct run)"},
		},
		Action: serverAction,
	}
}

func serverAction(c *cli.Context) error {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	prof := make(chan os.Signal, 1)
	if c.String("cpuprofile") != "" {
		signal.Notify(prof, syscall.SIGUSR1, syscall.SIGUSR2)
	}
	defer signal.Stop(stop)
	defer signal.Stop(prof)

	sl, err := subjects.ParseStreamLayout(c.String("layout"))
	if err != nil {
		return usageError{err}
	}
	lay, err := subjects.NewLayout(c.String("in"), "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", c.Int("partitions"))
	if err != nil {
		return usageError{err}
	}
	maps := mappings(setup.Config{Layout: lay, Names: subjects.Names{StreamLayout: sl}})
	if in := c.String("direct-in"); in != "" {
		dlay, err := subjects.NewLayout(in, "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", c.Int("partitions"))
		if err != nil {
			return usageError{err}
		}
		if maps == nil {
			maps = map[string]string{}
		}
		maps[dlay.MappingSource()] = dlay.MappingDest()
	}
	srv, url, err := startEmbedded(c.String("listen"), c.String("data-dir"), maps)
	if err != nil {
		return err
	}
	defer func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	}()
	fmt.Fprintln(c.App.Writer, url)

	var f *os.File
	defer func() {
		if f != nil {
			pprof.StopCPUProfile()
			f.Close()
		}
	}()
	for {
		select {
		case <-stop:
			return nil
		case s := <-prof:
			switch {
			case s == syscall.SIGUSR1 && f == nil:
				if f, err = os.Create(c.String("cpuprofile")); err != nil {
					return err
				}
				if err := pprof.StartCPUProfile(f); err != nil {
					return err
				}
			case s == syscall.SIGUSR2 && f != nil:
				pprof.StopCPUProfile()
				err := f.Close()
				f = nil
				if err != nil {
					return err
				}
			}
		}
	}
}
