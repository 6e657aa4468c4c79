package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"
)

// connFlags say how to reach NATS and who to be there; every command has them. Where the nats
// CLI reads an environment variable for the same setting, kvmapper reads it too, after its own.
func connFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "server", Aliases: []string{"s"}, Value: "nats://127.0.0.1:4222",
			Usage: "NATS server URL, or several separated by commas", EnvVars: []string{"KVMAPPER_SERVER", "NATS_URL"}},
		&cli.StringFlag{Name: "context", Usage: "connect as the nats CLI context `NAME` (see 'nats context save'), or a context .json file; the flags given here override its values",
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
		&cli.StringFlag{Name: "inbox-prefix", Usage: "subject prefix of reply inboxes (default _INBOX); a prefix of its own lets the subscribe permission name only kvmapper's replies", EnvVars: []string{"KVMAPPER_INBOX_PREFIX"}},
		&cli.DurationFlag{Name: "connect-timeout", Value: 2 * time.Second, Usage: "how long dialling one server may take", EnvVars: []string{"KVMAPPER_CONNECT_TIMEOUT"}},
		&cli.DurationFlag{Name: "reconnect-wait", Value: 250 * time.Millisecond, Usage: "pause between reconnect attempts to the same server", EnvVars: []string{"KVMAPPER_RECONNECT_WAIT"}},
	}
}

// connSettings is how to reach and authenticate to NATS: a nats CLI context, if any, overridden
// by the flags given. It holds secrets: never print it.
type connSettings struct {
	URL                   string
	User, Password, Token string
	Creds, NKey           string // files
	UserJWT, UserSeed     string // values, from a context only
	CA, Cert, Key         string // files
	TLSFirst              bool
	InboxPrefix           string
	ConnectTimeout        time.Duration
	ReconnectWait         time.Duration
	Context               string // path of the context file read, for messages
}

// connSettingsFrom builds the settings from the flags of c over the context they name, if any.
func connSettingsFrom(c *cli.Context) (connSettings, error) {
	var s connSettings
	if name := c.String("context"); name != "" {
		var err error
		if s, err = loadContext(name); err != nil {
			return connSettings{}, err
		}
	}
	// Credentials given as flags describe the whole identity: the context's are dropped, so a
	// context's password never travels with a --creds file. --password alone only replaces the
	// context's password.
	if c.IsSet("creds") || c.IsSet("nkey") || c.IsSet("user") || c.IsSet("token") {
		s.User, s.Password, s.Token, s.Creds, s.NKey, s.UserJWT, s.UserSeed = "", "", "", "", "", "", ""
	}
	for flag, to := range map[string]*string{
		"creds": &s.Creds, "nkey": &s.NKey, "user": &s.User, "password": &s.Password, "token": &s.Token,
		"tlsca": &s.CA, "tlscert": &s.Cert, "tlskey": &s.Key, "inbox-prefix": &s.InboxPrefix,
	} {
		if c.IsSet(flag) {
			*to = c.String(flag)
		}
	}
	if c.IsSet("server") || s.URL == "" {
		s.URL = c.String("server")
	}
	if c.IsSet("tls-first") {
		s.TLSFirst = c.Bool("tls-first")
	}
	s.ConnectTimeout, s.ReconnectWait = c.Duration("connect-timeout"), c.Duration("reconnect-wait")
	if s.ConnectTimeout <= 0 || s.ReconnectWait <= 0 {
		return connSettings{}, usagef("invalid value for flag --connect-timeout or --reconnect-wait: must be positive")
	}
	if s.User != "" && s.Password == "" && s.Token == "" {
		s.User, s.Token = "", s.User // the nats CLI's reading of a lone --user
	}
	n := 0
	for _, v := range []string{s.User, s.Creds, s.NKey, s.UserJWT, s.Token} {
		if v != "" {
			n++
		}
	}
	if n > 1 {
		return connSettings{}, usagef("give one of --creds, --nkey, --user/--password or --token (%s)", s.authLabel())
	}
	if s.Password != "" && s.User == "" {
		if n == 0 && !strings.Contains(s.URL, "@") {
			return connSettings{}, usagef("--password needs --user")
		}
		s.Password = "" // NATS_PASSWORD left over beside another identity, ignored as the nats CLI does
	}
	if (s.Cert == "") != (s.Key == "") {
		return connSettings{}, usagef("give --tlscert and --tlskey together")
	}
	for flag, p := range map[string]string{"creds": s.Creds, "nkey": s.NKey, "tlsca": s.CA, "tlscert": s.Cert, "tlskey": s.Key} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return connSettings{}, usagef("invalid value %q for flag --%s%s: %v", p, flag, s.fromContext(), errors.Unwrap(err))
		}
	}
	return s, nil
}

func (s connSettings) fromContext() string {
	if s.Context == "" {
		return ""
	}
	return " (or the context " + s.Context + ")"
}

// authLabel says how s authenticates, without any secret.
func (s connSettings) authLabel() string {
	var l []string
	for _, a := range []struct {
		set   bool
		label string
	}{
		{s.User != "", fmt.Sprintf("user %q with a password", s.User)},
		{s.Creds != "", "credentials file " + s.Creds},
		{s.NKey != "", "nkey seed file " + s.NKey},
		{s.UserJWT != "", "the context's user JWT"},
		{s.Token != "", "a token"},
		{redactURLs(s.URL) != s.URL, "the credentials in the server URL"},
	} {
		if a.set {
			l = append(l, a.label)
		}
	}
	if len(l) == 0 {
		return "no credentials"
	}
	return strings.Join(l, ", ")
}

// options turns s into nats.go options, after kvmapper's own.
func (s connSettings) options() ([]nats.Option, error) {
	var opts []nats.Option
	switch {
	case s.User != "":
		opts = append(opts, nats.UserInfo(s.User, s.Password))
	case s.Creds != "":
		opts = append(opts, nats.UserCredentials(s.Creds))
	case s.NKey != "":
		o, err := nats.NkeyOptionFromSeed(s.NKey)
		if err != nil {
			// nats.go's message may quote the file; it holds the seed.
			return nil, usagef("invalid value %q for flag --nkey%s: not an NKey seed file", s.NKey, s.fromContext())
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

// connect dials NATS for a kvmapper process. Publishing is not buffered while reconnecting
// (ReconnectBufSize -1): nothing sent then could overtake a message that failed, which is what
// keeps per-device order across reconnects (see package lanes).
// The flags of c add the nats CLI context, authentication and TLS; servers is the URL list to
// dial unless neither --server nor its environment variables were given and the context names one.
func connect(c *cli.Context, servers, name string, log zerolog.Logger) (*nats.Conn, error) {
	s, err := connSettingsFrom(c)
	if err != nil {
		return nil, err
	}
	if servers != c.String("server") || c.IsSet("server") || s.URL == "" {
		s.URL = servers // the embedded server's, or the one asked for
	}
	opts, err := s.options()
	if err != nil {
		return nil, err
	}
	limit := &logLimiter{every: time.Second}
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
		return nil, s.connectError(err)
	}
	return nc, nil
}

// connectError says what failed when dialling and what to change.
func (s connSettings) connectError(err error) error {
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

// permissionRE picks the operation and subject out of nats.go's permissions violation error.
var permissionRE = regexp.MustCompile(`(Publish|Subscription) to "([^"]+)"`)

// asyncError logs an error the server sent outside any request: at most one line per second
// for each kind (permissions, other), counting the rest as suppressed. A permissions violation
// names the permission to grant: kvmapper keeps retrying, so granting it resumes the work.
func asyncError(log zerolog.Logger, limit *logLimiter, sub *nats.Subscription, err error) {
	if errors.Is(err, nats.ErrPermissionViolation) {
		op, subject := "publish", ""
		if m := permissionRE.FindStringSubmatch(err.Error()); m != nil {
			subject = m[2]
			if m[1] == "Subscription" {
				op = "subscribe"
			}
		}
		suppressed, ok := limit.allow("permissions")
		if !ok {
			return
		}
		grant := grantFor(subject)
		log.Error().Str("operation", op).Str("subject", subject).Str("grant", grant).Int("suppressed", suppressed).
			Msgf("NATS permissions violation: this user may not %s to %q; grant it %s on %q (see the README, Least privilege)",
				op, subject, op, grant)
		return
	}
	suppressed, ok := limit.allow("other")
	if !ok {
		return
	}
	ev := log.Error().Err(err).Int("suppressed", suppressed)
	if sub != nil {
		ev = ev.Str("subject", sub.Subject)
	}
	ev.Msg("NATS error")
}

// grantFor returns the permission subject (as the README's least-privilege list spells it)
// that covers subject.
func grantFor(subject string) string {
	t := strings.Split(subject, ".")
	switch {
	case len(t) >= 6 && t[0] == "$JS" && t[1] == "API" && t[2] == "CONSUMER" && t[3] == "CREATE":
		return strings.Join(t[:5], ".") + ".>" // $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>
	case len(t) >= 6 && t[0] == "$JS" && t[1] == "API" && t[2] == "CONSUMER" && t[3] == "MSG" && t[4] == "NEXT":
		return strings.Join(t[:6], ".") + ".*"
	case len(t) >= 5 && t[0] == "$JS" && t[1] == "API" && t[2] == "CONSUMER":
		return strings.Join(t[:5], ".") + ".*"
	case len(t) >= 5 && t[0] == "$JS" && t[1] == "API" && t[2] == "DIRECT" && t[3] == "GET":
		return strings.Join(t[:5], ".") + ".>"
	case len(t) >= 2 && t[0] == "$JS" && t[1] == "API":
		return subject
	case len(t) >= 3 && t[0] == "$JS" && t[1] == "FC":
		return "$JS.FC." + t[2] + ".>"
	case len(t) >= 2 && t[0] == "$KV":
		return "$KV." + t[1] + ".>"
	case t[0] == "$SRV":
		return "$SRV.>"
	case len(t) >= 3 && t[0] == "kvmapper" && t[1] == "status":
		return strings.Join(t[:len(t)-1], ".") + ".*" // every replica's status endpoint
	case t[0] == "kvmapper" || t[0] == "$JS":
		return subject
	}
	return t[0] + ".>" // the outputs (outgoing.>, unmapped.>) and inboxes (_INBOX.>)
}

// logLimiter lets one line per kind through every interval and counts the others. It is safe
// for concurrent use.
type logLimiter struct {
	every time.Duration
	mu    sync.Mutex
	last  map[string]time.Time
	skip  map[string]int
}

// allow reports whether a line of kind may be logged now, and how many were held back since the
// last one that was.
func (l *logLimiter) allow(kind string) (int, bool) { return l.allowAt(kind, time.Now()) }

func (l *logLimiter) allowAt(kind string, now time.Time) (int, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil {
		l.last, l.skip = map[string]time.Time{}, map[string]int{}
	}
	if last, ok := l.last[kind]; ok && now.Sub(last) < l.every {
		l.skip[kind]++
		return 0, false
	}
	n := l.skip[kind]
	l.last[kind], l.skip[kind] = now, 0
	return n, true
}

// dial connects to the servers of --server (or the context) for a command that runs once, and
// returns the connection with a JetStream context on it; the caller closes the connection.
func dial(c *cli.Context, name string, log zerolog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := connect(c, c.String("server"), name, log)
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}
