package natsconn_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/natsconn"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// logBuffer collects log lines written from nats.go's goroutines; it is safe for concurrent use.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// line returns the first logged line whose message contains msg, decoded.
func (b *logBuffer) line(msg string) (map[string]any, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for l := range strings.Lines(b.buf.String()) {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			return nil, fmt.Errorf("log line %q: %w", l, err)
		}
		if s, _ := m["message"].(string); strings.Contains(s, msg) {
			return m, nil
		}
	}
	return nil, fmt.Errorf("no log line says %q in %q", msg, b.buf.String())
}

// settings returns settings that reach url, with the tests' timeouts.
func settings(url string) natsconn.Settings {
	return natsconn.Settings{URL: url, ConnectTimeout: 2 * time.Second, ReconnectWait: 50 * time.Millisecond}
}

// dial calls Dial and closes the connection with t.Cleanup.
func dial(t *testing.T, s natsconn.Settings, log zerolog.Logger) {
	t.Helper()
	nc, js, err := natsconn.Dial(s, "kvmapper test", log)
	if err != nil {
		t.Fatalf("Dial(%s): %v", s.URL, err)
	}
	t.Cleanup(nc.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		t.Fatalf("AccountInfo on the JetStream context Dial returned: %v", err)
	}
}

func TestDialOptions(t *testing.T) {
	srv := natstest.Start(t, func(o *server.Options) {
		o.Users = []*server.User{{Username: "mapper", Password: secret}}
	})
	s := settings(srv.URL())
	s.User, s.Password, s.InboxPrefix = "mapper", secret, "_INBOX_kvmapper"
	nc, js, err := natsconn.Dial(s, "kvmapper m1", zerolog.Nop())
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer nc.Close()
	if js == nil {
		t.Fatal("Dial returned no JetStream context")
	}
	o := nc.Opts
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"Name", o.Name, "kvmapper m1"},
		// Nothing is buffered while reconnecting: see the doc of Dial.
		{"ReconnectBufSize", o.ReconnectBufSize, -1},
		{"MaxReconnect", o.MaxReconnect, -1},
		{"RetryOnFailedConnect", o.RetryOnFailedConnect, false},
		{"Timeout", o.Timeout, s.ConnectTimeout},
		{"ReconnectWait", o.ReconnectWait, s.ReconnectWait},
		{"InboxPrefix", o.InboxPrefix, "_INBOX_kvmapper"},
		{"AsyncErrorCB set", o.AsyncErrorCB != nil, true},
		{"DisconnectedErrCB set", o.DisconnectedErrCB != nil, true},
		{"ReconnectedCB set", o.ReconnectedCB != nil, true},
	} {
		if c.got != c.want {
			t.Errorf("Opts.%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestDialLoneUserIsAToken(t *testing.T) {
	srv := natstest.Start(t, func(o *server.Options) { o.Authorization = secret })
	s := settings(srv.URL())
	s.User = secret
	dial(t, s, zerolog.Nop())
}

func TestDialTLS(t *testing.T) {
	withTLS, ca := natstest.TLS(t)
	srv := natstest.Start(t, withTLS)
	s := settings(srv.URL())
	_, _, err := natsconn.Dial(s, "kvmapper test", zerolog.Nop())
	if err == nil || !strings.Contains(err.Error(), "pass the CA that signed the server's certificate with --tlsca FILE") {
		t.Errorf("Dial without the CA = %v, want an error naming --tlsca", err)
	}
	s.CA = ca
	dial(t, s, zerolog.Nop())
}

func TestDialErrors(t *testing.T) {
	srv := natstest.Start(t, func(o *server.Options) {
		o.Users = []*server.User{{Username: "mapper", Password: "right-password"}}
	})
	_, ca := natstest.TLS(t)
	userAt := strings.Replace(srv.URL(), "nats://", "nats://mapper:"+secret+"@", 1)
	for _, tc := range []struct {
		name string
		set  func(s *natsconn.Settings)
		want []string
	}{
		{"password", func(s *natsconn.Settings) { s.User, s.Password = "mapper", secret },
			[]string{"connecting to NATS at " + srv.URL() + ": authorization violation: the server refused user \"mapper\" with a password", "check --creds"}},
		{"token from a context", func(s *natsconn.Settings) { s.Token, s.ContextPath = secret, "/ctx.json" },
			[]string{"refused a token", "or --token (or the context /ctx.json)"}},
		{"url", func(s *natsconn.Settings) { s.URL = userAt },
			[]string{"nats://redacted@127.0.0.1", "refused the credentials in the server URL"}},
		{"no server", func(s *natsconn.Settings) { s.URL = "nats://mapper:" + secret + "@127.0.0.1:1" },
			[]string{"nats://redacted@127.0.0.1:1", "is a server running? try kvmapper run --embedded"}},
		{"TLS to a plain server", func(s *natsconn.Settings) { s.User, s.Password, s.CA = "mapper", "right-password", ca },
			[]string{"TLS options were given", "does not offer TLS"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := settings(srv.URL())
			tc.set(&s)
			nc, _, err := natsconn.Dial(s, "kvmapper test", zerolog.Nop())
			if err == nil {
				nc.Close()
				t.Fatalf("Dial() = nil error, want one saying %q", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Dial() error %q does not say %q", err, w)
				}
			}
			if errors.Is(err, natsconn.ErrInvalid) || strings.Contains(err.Error(), secret) {
				t.Errorf("Dial() error %q is ErrInvalid or shows the secret", err)
			}
		})
	}
	t.Run("invalid settings", func(t *testing.T) {
		s := settings(srv.URL())
		s.Password = secret
		if _, _, err := natsconn.Dial(s, "kvmapper test", zerolog.Nop()); !errors.Is(err, natsconn.ErrInvalid) {
			t.Errorf("Dial() with a password alone = %v, want ErrInvalid", err)
		}
	})
}

func TestDialLogsPermissionViolations(t *testing.T) {
	srv := natstest.Start(t, func(o *server.Options) {
		o.Users = []*server.User{{Username: "mapper", Password: secret, Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Deny: []string{"outgoing.>"}},
		}}}
	})
	var logs logBuffer
	s := settings(srv.URL())
	s.User, s.Password = "mapper", secret
	nc, _, err := natsconn.Dial(s, "kvmapper test", zerolog.New(&logs))
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer nc.Close()
	if err := nc.Publish("outgoing.g.dev.evt", nil); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		l, err := logs.line("permissions violation")
		if err != nil {
			return err
		}
		if l["operation"] != "publish" || l["subject"] != "outgoing.g.dev.evt" || l["grant"] != "outgoing.>" {
			t.Fatalf("violation logged as %v, want operation publish, subject outgoing.g.dev.evt, grant outgoing.>", l)
		}
		return nil
	})
}

func TestDialLogsReconnects(t *testing.T) {
	srv := natstest.Start(t)
	url := srv.URL()
	var logs logBuffer
	nc, _, err := natsconn.Dial(settings(url), "kvmapper test", zerolog.New(&logs))
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer nc.Close()
	srv.Restart()
	natstest.Eventually(t, 10*time.Second, func() error {
		if _, err := logs.line("disconnected from NATS; reconnecting"); err != nil {
			return err
		}
		l, err := logs.line("reconnected to NATS")
		if err != nil {
			return err
		}
		if l["server"] != url {
			t.Fatalf("reconnect logged as %v, want server %s", l, url)
		}
		return nil
	})
}
