package natsconn

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// ErrInvalid marks an error in the values given: a context name that names no context file,
// conflicting credentials, a missing file. A context file that cannot be read or used, and a
// failure to connect, are not marked. Test for it with errors.Is; the message of an error that
// wraps it is the message alone, without this sentinel's.
var ErrInvalid = errors.New("natsconn: invalid settings")

// invalidError is an error in the values given: errors.Is(err, ErrInvalid) holds, and its
// message is the one that says what to fix, as the user reads it.
type invalidError struct{ err error }

func (e invalidError) Error() string        { return e.err.Error() }
func (e invalidError) Unwrap() error        { return e.err }
func (e invalidError) Is(target error) bool { return target == ErrInvalid }

func invalidf(format string, a ...any) error { return invalidError{fmt.Errorf(format, a...)} }

// Settings say how to reach and authenticate to NATS, as a nats CLI context does. They hold
// secrets (Password, Token, UserSeed): never print or log them. A Settings is a plain value,
// safe to copy.
type Settings struct {
	// URL is the server URL, or several separated by commas.
	URL string
	// User is sent with Password. A User without Password or Token is sent as a token, as the
	// nats CLI does.
	User, Password, Token string
	Creds, NKey           string // files
	UserJWT, UserSeed     string // values, from a context only
	CA, Cert, Key         string // files
	// TLSFirst starts TLS before the server's greeting (servers with handshake_first).
	TLSFirst bool
	// InboxPrefix replaces _INBOX as the subject prefix of reply inboxes.
	InboxPrefix string
	// ConnectTimeout bounds the dialling of one server and ReconnectWait is the pause between
	// reconnect attempts to the same server; both must be positive.
	ConnectTimeout, ReconnectWait time.Duration
	// ContextPath is the context file the settings were read from, for messages; [LoadContext]
	// sets it.
	ContextPath string
}

// Overrides are values given explicitly, say as flags, that take the place of a context's.
// A nil field keeps the context's value; a field that points to "" clears it.
type Overrides struct {
	URL, User, Password, Token, Creds, NKey, CA, Cert, Key, InboxPrefix *string
	TLSFirst                                                            *bool
}

// Over returns base with the values of o in its place. Any of User, Token, Creds or NKey in o
// describes the whole identity: base's credentials are all dropped, so that a context's password
// never travels with a credentials file given in o. Password alone replaces only the password.
func (o Overrides) Over(base Settings) Settings {
	s := base
	if o.User != nil || o.Token != nil || o.Creds != nil || o.NKey != nil {
		s.User, s.Password, s.Token, s.Creds, s.NKey, s.UserJWT, s.UserSeed = "", "", "", "", "", "", ""
	}
	for _, f := range []struct{ from, to *string }{
		{o.URL, &s.URL}, {o.User, &s.User}, {o.Password, &s.Password}, {o.Token, &s.Token},
		{o.Creds, &s.Creds}, {o.NKey, &s.NKey}, {o.CA, &s.CA}, {o.Cert, &s.Cert}, {o.Key, &s.Key},
		{o.InboxPrefix, &s.InboxPrefix},
	} {
		if f.from != nil {
			*f.to = *f.from
		}
	}
	if o.TLSFirst != nil {
		s.TLSFirst = *o.TLSFirst
	}
	return s
}

// Validate reports whether s can be dialled: one identity at most, a password only with a user,
// a client certificate with its key, positive timeouts, and files that exist (the NKey file a
// seed). Its errors wrap [ErrInvalid] and name the kvmapper flag to fix; it reads the files but
// does not connect.
func (s Settings) Validate() error {
	s, err := s.resolved()
	if err != nil {
		return err
	}
	_, err = s.nkeyOption()
	return err
}

// resolved returns s as it is dialled, the way the nats CLI reads it, or why it cannot be. It
// checks all that [Settings.Validate] does but the NKey seed, which [Settings.options] reads.
func (s Settings) resolved() (Settings, error) {
	if s.ConnectTimeout <= 0 || s.ReconnectWait <= 0 {
		return Settings{}, invalidf("invalid value for flag --connect-timeout or --reconnect-wait: must be positive")
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
		return Settings{}, invalidf("give one of --creds, --nkey, --user/--password or --token (%s)", s.authLabel())
	}
	if s.Password != "" && s.User == "" {
		if n == 0 && !strings.Contains(s.URL, "@") {
			return Settings{}, invalidf("--password needs --user")
		}
		s.Password = "" // NATS_PASSWORD left over beside another identity, ignored as the nats CLI does
	}
	if (s.Cert == "") != (s.Key == "") {
		return Settings{}, invalidf("give --tlscert and --tlskey together")
	}
	for flag, p := range map[string]string{"creds": s.Creds, "nkey": s.NKey, "tlsca": s.CA, "tlscert": s.Cert, "tlskey": s.Key} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return Settings{}, invalidf("invalid value %q for flag --%s%s: %v", p, flag, s.fromContext(), errors.Unwrap(err))
		}
	}
	return s, nil
}

// nkeyOption reads the NKey seed file, if any.
func (s Settings) nkeyOption() (nats.Option, error) {
	if s.NKey == "" {
		return nil, nil
	}
	o, err := nats.NkeyOptionFromSeed(s.NKey)
	if err != nil {
		// nats.go's message may quote the file; it holds the seed.
		return nil, invalidf("invalid value %q for flag --nkey%s: not an NKey seed file", s.NKey, s.fromContext())
	}
	return o, nil
}

func (s Settings) fromContext() string {
	if s.ContextPath == "" {
		return ""
	}
	return " (or the context " + s.ContextPath + ")"
}

// authLabel says how s authenticates, without any secret.
func (s Settings) authLabel() string {
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
