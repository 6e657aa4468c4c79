package cli

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/internal/natsconn"
)

// connFlags say how to reach NATS and who to be there; every command has them. Where the nats
// CLI reads an environment variable for the same setting, kvmapper reads it too, after its own.
func connFlags() []cli.Flag {
	return in(catConnection,
		&cli.StringFlag{Name: "server", Aliases: []string{"s"}, Value: "nats://127.0.0.1:4222",
			Usage: "NATS server URL, or several separated by commas", EnvVars: []string{"KVMAPPER_SERVER", "NATS_URL"}},
		&cli.StringFlag{Name: "context", Usage: "connect as the nats CLI context `NAME`, or a context .json file; flags override it",
			EnvVars: []string{"KVMAPPER_CONTEXT", "NATS_CONTEXT"}},
		&cli.StringFlag{Name: "creds", Usage: "user credentials `FILE` (JWT and NKey seed)", TakesFile: true, EnvVars: []string{"KVMAPPER_CREDS", "NATS_CREDS"}},
		&cli.StringFlag{Name: "nkey", Usage: "user NKey seed `FILE`", TakesFile: true, EnvVars: []string{"KVMAPPER_NKEY", "NATS_NKEY"}},
		&cli.StringFlag{Name: "user", Usage: "user name (without --password it is sent as a token, as the nats CLI does)", EnvVars: []string{"KVMAPPER_USER", "NATS_USER"}},
		&cli.StringFlag{Name: "password", Usage: "password of --user (prefer the environment variable: flags show in ps)", EnvVars: []string{"KVMAPPER_PASSWORD", "NATS_PASSWORD"}},
		&cli.StringFlag{Name: "token", Usage: "authentication token (prefer the environment variable: flags show in ps)", EnvVars: []string{"KVMAPPER_TOKEN", "NATS_TOKEN"}},
		&cli.StringFlag{Name: "tlsca", Usage: "`FILE` of the CA certificates that signed the server's certificate", TakesFile: true, EnvVars: []string{"KVMAPPER_TLSCA", "NATS_CA"}},
		&cli.StringFlag{Name: "tlscert", Usage: "client certificate `FILE`, for servers that verify clients", TakesFile: true, EnvVars: []string{"KVMAPPER_TLSCERT", "NATS_CERT"}},
		&cli.StringFlag{Name: "tlskey", Usage: "private key `FILE` of --tlscert", TakesFile: true, EnvVars: []string{"KVMAPPER_TLSKEY", "NATS_KEY"}},
		&cli.BoolFlag{Name: "tls-first", Aliases: []string{"tlsfirst"}, Usage: "start TLS before the server's greeting (servers with handshake_first)", EnvVars: []string{"KVMAPPER_TLS_FIRST"}},
		&cli.StringFlag{Name: "inbox-prefix", Usage: "subject prefix of reply inboxes (default _INBOX)", EnvVars: []string{"KVMAPPER_INBOX_PREFIX"}},
		&cli.DurationFlag{Name: "connect-timeout", Value: 2 * time.Second, Usage: "how long dialling one server may take", EnvVars: []string{"KVMAPPER_CONNECT_TIMEOUT"}},
		&cli.DurationFlag{Name: "reconnect-wait", Value: 250 * time.Millisecond, Usage: "pause between reconnect attempts to the same server", EnvVars: []string{"KVMAPPER_RECONNECT_WAIT"}},
	)
}

// connSettings maps the connection flags of c onto [natsconn.Settings]: over the nats CLI context
// they name, if any, only the flags given (on the command line or in the environment) replace the
// context's values. An invalid value is a usage error.
func connSettings(c *cli.Context) (natsconn.Settings, error) {
	var s natsconn.Settings
	if name := c.String("context"); name != "" {
		var err error
		if s, err = natsconn.LoadContext(name); err != nil {
			if errors.Is(err, natsconn.ErrInvalid) {
				err = usageError{err}
			}
			return natsconn.Settings{}, err
		}
	}
	given := func(flag string) *string {
		if !c.IsSet(flag) {
			return nil
		}
		v := c.String(flag)
		return &v
	}
	o := natsconn.Overrides{
		URL: given("server"), User: given("user"), Password: given("password"), Token: given("token"),
		Creds: given("creds"), NKey: given("nkey"), CA: given("tlsca"), Cert: given("tlscert"), Key: given("tlskey"),
		InboxPrefix: given("inbox-prefix"),
	}
	if c.IsSet("tls-first") {
		v := c.Bool("tls-first")
		o.TLSFirst = &v
	}
	s = o.Over(s)
	if s.URL == "" {
		s.URL = c.String("server")
	}
	s.ConnectTimeout, s.ReconnectWait = c.Duration("connect-timeout"), c.Duration("reconnect-wait")
	if err := s.Validate(); err != nil {
		return natsconn.Settings{}, usageError{err}
	}
	return s, nil
}

// dial connects to NATS as the connection flags of c say, the connection named name; url, if not
// empty, replaces the server they name (run --embedded). The caller closes the connection.
func dial(c *cli.Context, name, url string, log zerolog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	s, err := connSettings(c)
	if err != nil {
		return nil, nil, err
	}
	if url != "" {
		s.URL = url
	}
	return natsconn.Dial(s, name, log)
}

// connect dials for a command that works on a deployment setup made, the connection named
// "kvmapper <command>", and resolves --layout auto into cm.setup (resolveLayout). The caller
// closes the connection.
func (cm *common) connect(ctx context.Context, c *cli.Context) (*nats.Conn, jetstream.JetStream, error) {
	nc, js, err := dial(c, "kvmapper "+c.Command.Name, "", cm.log)
	if err != nil {
		return nil, nil, err
	}
	if err := cm.resolveLayout(ctx, js); err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}
