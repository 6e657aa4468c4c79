package cli

import (
	"errors"
	"os"
	"os/signal"
	"syscall"

	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/subjects"
)

// serverCommand runs only an embedded NATS server with JetStream: kvmapper bench starts one as a
// child process (bench.StartServer), so that the server's CPU is its own and the bench can read it.
func serverCommand() *cli.Command {
	return &cli.Command{
		Name:        "server",
		Usage:       "run only an embedded NATS server with JetStream until SIGINT or SIGTERM",
		Hidden:      true,
		Description: "With --cpuprofile, SIGUSR1 starts a CPU profile of the server and SIGUSR2 writes it.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "listen", Value: "127.0.0.1:4222", Usage: "host:port to listen on"},
			&cli.StringFlag{Name: "data-dir", Value: "kvmapper-data", Usage: "JetStream data directory"},
			&cli.StringFlag{Name: "cpuprofile", Usage: "file for a CPU profile taken between SIGUSR1 and SIGUSR2"},
			&cli.StringFlag{Name: "layout", Value: string(subjects.SingleStream), Usage: "streams: give the server the account mapping of the partition-streams layout"},
			&cli.IntFlag{Name: "partitions", Value: 16, Usage: "partitions of that mapping"},
			&cli.StringFlag{Name: "in", Value: "incoming.{device}.{event}", Usage: "subject template of that mapping"},
			&cli.StringFlag{Name: "direct-in", Usage: "also map this subject template into partitions, as direct mode's mapping receive mode needs (the bench's direct run)"},
			&cli.StringFlag{Name: "name", Usage: "the server's name (each node of a cluster needs its own)"},
			&cli.StringFlag{Name: "cluster-name", Value: "kvmapper-bench", Usage: "with --cluster-listen: the cluster's name"},
			&cli.StringFlag{Name: "cluster-listen", Usage: "host:port to accept cluster routes on (the bench's --cluster runs)"},
			&cli.StringFlag{Name: "routes", Usage: "with --cluster-listen: every node's nats-route://host:port, comma-separated"},
		},
		Action: func(c *cli.Context) error {
			sl, err := subjects.ParseStreamLayout(c.String("layout"))
			if err != nil {
				return usageError{err}
			}
			ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
			defer stop()
			err = bench.Serve(ctx, bench.ServerConfig{Listen: c.String("listen"), Dir: c.String("data-dir"), CPUProfile: c.String("cpuprofile"),
				StreamLayout: sl, Partitions: c.Int("partitions"), In: c.String("in"), DirectIn: c.String("direct-in"),
				Name: c.String("name"), ClusterName: c.String("cluster-name"), ClusterListen: c.String("cluster-listen"),
				Routes: bench.List(c.String("routes"))}, c.App.Writer)
			if errors.Is(err, bench.ErrInvalidConfig) {
				return usageError{err}
			}
			return err
		},
	}
}
