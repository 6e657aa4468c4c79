package natsconn

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/ratelog"
)

// Dial connects to the servers of s as a kvmapper process called name, and returns the
// connection with a JetStream context on it; the caller closes the connection. It validates s
// first ([Settings.Validate]) and blocks until the connection is made or has failed: about
// ConnectTimeout per server URL, with no retry. nats.go cannot cancel a connect, so Dial takes
// no context. A failure to connect is an error that names the servers (credentials in URLs
// redacted) and says what to change.
//
// Publishing is not buffered while reconnecting (ReconnectBufSize -1): nothing sent then could
// overtake a message that failed, which is what keeps per-device order across reconnects (see
// package lanes). The connection reconnects forever; disconnects and reconnects are logged to
// log, and so are errors the server sends outside any request, at most one line per second for
// each kind, a permissions violation naming the permission to grant.
func Dial(s Settings, name string, log zerolog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	s, err := s.resolved()
	if err != nil {
		return nil, nil, err
	}
	opts, err := s.options()
	if err != nil {
		return nil, nil, err
	}
	limit := &ratelog.Limiter{Every: time.Second}
	opts = append(opts,
		nats.Name(name),
		nats.MaxReconnects(-1),
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
			asyncError(log, limit, sub, err)
		}),
	)
	nc, err := nats.Connect(s.URL, opts...)
	if err != nil {
		return nil, nil, s.connectError(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// options turns s, as resolved, into nats.go options, before kvmapper's own.
func (s Settings) options() ([]nats.Option, error) {
	var opts []nats.Option
	switch {
	case s.User != "":
		opts = append(opts, nats.UserInfo(s.User, s.Password))
	case s.Creds != "":
		opts = append(opts, nats.UserCredentials(s.Creds))
	case s.NKey != "":
		o, err := s.nkeyOption()
		if err != nil {
			return nil, err
		}
		opts = append(opts, o)
	case s.UserJWT != "":
		opts = append(opts, nats.UserJWTAndSeed(s.UserJWT, s.UserSeed))
	case s.Token != "":
		opts = append(opts, nats.Token(s.Token))
	}
	if s.CA != "" {
		opts = append(opts, nats.RootCAs(s.CA))
	}
	if s.Cert != "" {
		opts = append(opts, nats.ClientCert(s.Cert, s.Key))
	}
	if s.TLSFirst {
		opts = append(opts, nats.TLSHandshakeFirst())
	}
	if s.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(s.InboxPrefix))
	}
	return append(opts, nats.Timeout(s.ConnectTimeout), nats.ReconnectWait(s.ReconnectWait)), nil
}

// connectError says what failed when dialling and what to change.
func (s Settings) connectError(err error) error {
	at := redactURLs(s.URL)
	var (
		hostname x509.HostnameError
		verify   *tls.CertificateVerificationError // wraps x509's unknown authority, expiry…
		record   tls.RecordHeaderError
	)
	// A TLS alert from the server (say, certificate required) has no exported type.
	alert := strings.Contains(err.Error(), "tls:")
	switch {
	case errors.Is(err, nats.ErrAuthorization), errors.Is(err, nats.ErrAuthExpired), errors.Is(err, nats.ErrAuthRevoked),
		errors.Is(err, nats.ErrAccountAuthExpired):
		return fmt.Errorf("connecting to NATS at %s: authorization violation: the server refused %s (%w); check --creds, --nkey, --user/--password or --token%s",
			at, s.authLabel(), err, s.fromContext())
	case errors.Is(err, nats.ErrSecureConnWanted):
		return fmt.Errorf("connecting to NATS at %s: %w: TLS options were given (--tlsca, --tlscert, --tls-first) but the server does not offer TLS", at, err)
	case errors.As(err, &hostname):
		return fmt.Errorf("connecting to NATS at %s: TLS: %w: connect by a name the certificate holds, or reissue it (--tlsca is the CA's file)", at, err)
	case errors.As(err, &verify):
		return fmt.Errorf("connecting to NATS at %s: TLS: %w: pass the CA that signed the server's certificate with --tlsca FILE", at, err)
	case errors.As(err, &record), errors.Is(err, nats.ErrSecureConnRequired), alert:
		return fmt.Errorf("connecting to NATS at %s: TLS: %w: check --tlsca, and --tlscert/--tlskey if the server verifies clients, and --tls-first if it wants TLS before its greeting", at, err)
	}
	return fmt.Errorf("connecting to NATS at %s: %w (is a server running? try kvmapper run --embedded)", at, err)
}

// redactURLs replaces the user information of each URL in a comma-separated list.
func redactURLs(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		if u, err := url.Parse(strings.TrimSpace(p)); err == nil && u.User != nil {
			u.User = url.User("redacted")
			parts[i] = u.String()
		}
	}
	return strings.Join(parts, ",")
}
