package main

import (
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/urfave/cli/v2"
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

	srv, url, err := startEmbedded(c.String("listen"), c.String("data-dir"))
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
