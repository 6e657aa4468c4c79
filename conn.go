package main

import (
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"
)

// connFlags say how to reach NATS; every command has them.
func connFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "server", Aliases: []string{"s"}, Value: "nats://127.0.0.1:4222",
			Usage: "NATS server URL, or several separated by commas", EnvVars: []string{"KVMAPPER_SERVER", "NATS_URL"}},
	}
}

// connect dials NATS for a kvmapper process. Publishing is not buffered while reconnecting
// (ReconnectBufSize -1): nothing sent then could overtake a message that failed, which is what
// keeps per-device order across reconnects (see package lanes).
// The flags of c add authentication and TLS; servers is the URL list to dial.
func connect(_ *cli.Context, servers, name string, log zerolog.Logger) (*nats.Conn, error) {
	opts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectBufSize(-1),
		nats.RetryOnFailedConnect(false),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn().Err(err).Msg("disconnected from NATS; reconnecting")
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info().Str("server", nc.ConnectedUrlRedacted()).Msg("reconnected to NATS")
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			ev := log.Error().Err(err)
			if sub != nil {
				ev = ev.Str("subject", sub.Subject)
			}
			ev.Msg("NATS error")
		}),
	}
	nc, err := nats.Connect(servers, opts...)
	if err != nil {
		return nil, fmt.Errorf("connecting to NATS at %s: %w (is a server running? try kvmapper run --embedded)", servers, err)
	}
	return nc, nil
}

