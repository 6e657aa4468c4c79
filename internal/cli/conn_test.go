package cli

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/internal/natsconn"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// secret is the password, token or seed the tests hide; it must never appear in output.
const secret = "hunter2-s3cret"

// settingsFor parses args (after the program name) with the connection flags and returns
// connSettings's result.
func settingsFor(t *testing.T, args ...string) (natsconn.Settings, error) {
	t.Helper()
	var s natsconn.Settings
	var err error
	app := &cli.App{Flags: connFlags(), Writer: &bytes.Buffer{}, ErrWriter: &bytes.Buffer{},
		Action: func(c *cli.Context) error {
			s, err = connSettings(c)
			return nil
		}}
	if rerr := app.Run(append([]string{"kvmapper"}, args...)); rerr != nil {
		t.Fatalf("app.Run(%v): %v", args, rerr)
	}
	return s, err
}

// writeContext writes a nats CLI context under a fresh XDG_CONFIG_HOME and returns its path.
func writeContext(t *testing.T, name string, ctx map[string]any) string {
	t.Helper()
	home := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", home)
	for _, v := range []string{"NATS_URL", "NATS_CONTEXT", "NATS_USER", "NATS_PASSWORD", "NATS_TOKEN", "NATS_CREDS", "NATS_NKEY", "NATS_CA", "NATS_CERT", "NATS_KEY"} {
		t.Setenv(v, "")
		os.Unsetenv(v)
	}
	dir := filepath.Join(home, "nats", "context")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(ctx)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name+".json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func touch(t *testing.T, name string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestConnContextIsRead(t *testing.T) {
	ca := touch(t, "ca.pem")
	t.Setenv("CA_DIR", filepath.Dir(ca))
	t.Setenv("CTX_TOKEN", secret)
	path := writeContext(t, "prod", map[string]any{
		"url": "nats://a:4222,nats://b:4222", "token": "env://CTX_TOKEN", "ca": "$CA_DIR/ca.pem",
		"inbox_prefix": "_INBOX_kvmapper", "tls_first": true, "description": "ignored",
	})
	s, err := settingsFor(t, "--context", "prod")
	if err != nil {
		t.Fatalf("connSettings: %v", err)
	}
	want := natsconn.Settings{URL: "nats://a:4222,nats://b:4222", Token: secret, CA: ca, InboxPrefix: "_INBOX_kvmapper", TLSFirst: true,
		ConnectTimeout: 2 * time.Second, ReconnectWait: 250 * time.Millisecond, ContextPath: path}
	if s != want {
		t.Errorf("connSettings() = %+v, want %+v", s, want)
	}
	// The environment variable the nats CLI reads names the context too; a .json path works.
	t.Setenv("NATS_CONTEXT", path)
	if s, err := settingsFor(t); err != nil || s.URL != want.URL {
		t.Errorf("NATS_CONTEXT=%s: URL %q, err %v; want %q", path, s.URL, err, want.URL)
	}
}

func TestConnFlagsOverrideContext(t *testing.T) {
	creds := touch(t, "user.creds")
	writeContext(t, "dev", map[string]any{"url": "nats://ctx:4222", "user": "alice", "password": "data:;base64," + base64.StdEncoding.EncodeToString([]byte(secret)),
		"tls_first": true, "inbox_prefix": "_INBOX_ctx"})
	for _, tc := range []struct {
		name string
		args []string
		want func(natsconn.Settings) error
	}{
		{"context alone", nil, func(s natsconn.Settings) error {
			if s.URL != "nats://ctx:4222" || s.User != "alice" || s.Password != secret || !s.TLSFirst || s.InboxPrefix != "_INBOX_ctx" {
				return errors.New("want the context's url, user, decoded password, tls_first and inbox_prefix")
			}
			return nil
		}},
		{"server flag", []string{"--server", "nats://flag:4222"}, func(s natsconn.Settings) error {
			if s.URL != "nats://flag:4222" || s.User != "alice" {
				return errors.New("want the flag's URL and the context's user")
			}
			return nil
		}},
		{"creds flag replaces the identity", []string{"--creds", creds}, func(s natsconn.Settings) error {
			if s.Creds != creds || s.User != "" || s.Password != "" {
				return errors.New("want the creds file only")
			}
			return nil
		}},
		{"password flag replaces the password", []string{"--password", "other"}, func(s natsconn.Settings) error {
			if s.User != "alice" || s.Password != "other" {
				return errors.New("want alice with the flag's password")
			}
			return nil
		}},
		{"user flag replaces the identity", []string{"--user", "tok"}, func(s natsconn.Settings) error {
			if s.User != "tok" || s.Password != "" || s.Token != "" {
				return errors.New("want user tok without the context's password")
			}
			return nil
		}},
		{"false flag overrides a true context value", []string{"--tls-first=false", "--inbox-prefix", ""}, func(s natsconn.Settings) error {
			if s.TLSFirst || s.InboxPrefix != "" {
				return errors.New("want tls_first and inbox_prefix cleared")
			}
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := settingsFor(t, append([]string{"--context", "dev"}, tc.args...)...)
			if err != nil {
				t.Fatalf("connSettings: %v", err)
			}
			if err := tc.want(s); err != nil {
				t.Errorf("connSettings() = %+v: %v", s, err)
			}
		})
	}
	t.Run("environment", func(t *testing.T) {
		t.Setenv("NATS_URL", "nats://env:4222")
		s, err := settingsFor(t, "--context", "dev")
		if err != nil || s.URL != "nats://env:4222" {
			t.Errorf("NATS_URL over a context: URL %q, err %v; want nats://env:4222", s.URL, err)
		}
	})
}

// TestConnFlagErrors checks that what the user typed wrong is a usage error (exit code 2) and
// that a context file kvmapper cannot use is not; internal/natsconn tests the messages in full.
func TestConnFlagErrors(t *testing.T) {
	path := writeContext(t, "odd", map[string]any{"url": "nats://x:4222", "password": secret})
	for _, tc := range []struct {
		name    string
		context any
		args    []string
		want    string
		usage   bool
	}{
		{"missing", nil, []string{"--context", "nope"}, filepath.Join(filepath.Dir(path), "nope.json") + " does not exist", true},
		{"path in name", nil, []string{"--context", "../etc/x"}, "path separators", true},
		{"bad json", `{"password": "` + secret + `", `, []string{"--context", "ctx"}, "invalid JSON", false},
		{"domain", map[string]any{"jetstream_domain": "hub"}, []string{"--context", "ctx"}, "does not support", false},
		{"two identities", nil, []string{"--user", "u", "--password", "p", "--token", secret}, "give one of", true},
		{"password without user", nil, []string{"--password", secret}, "--password needs --user", true},
		{"missing creds file", nil, []string{"--creds", "/no/such.creds"}, "/no/such.creds", true},
		{"zero timeout", nil, []string{"--connect-timeout", "0s"}, "must be positive", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			switch c := tc.context.(type) {
			case string:
				p := writeContext(t, "ctx", nil)
				if err := os.WriteFile(p, []byte(c), 0o600); err != nil {
					t.Fatal(err)
				}
			case map[string]any:
				writeContext(t, "ctx", c)
			}
			_, err := settingsFor(t, tc.args...)
			if err == nil {
				t.Fatalf("connSettings(%v) = nil error, want one saying %q", tc.args, tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("connSettings(%v) error %q does not say %q", tc.args, err, tc.want)
			}
			if usage := errors.As(err, new(usageError)); usage != tc.usage {
				t.Errorf("connSettings(%v) error %q is a usage error: %v, want %v", tc.args, err, usage, tc.usage)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("error %q shows the secret", err)
			}
		})
	}
}

func TestConnMissingContextExitsWithUsageError(t *testing.T) {
	writeContext(t, "other", map[string]any{})
	var stdout, stderr bytes.Buffer
	code := Main([]string{"kvmapper", "setup", "--context", "nope"}, &stdout, &stderr, Build{})
	if code != 2 || !strings.Contains(stderr.String(), "nope.json does not exist") {
		t.Errorf("setup --context nope: exit %d, stderr %q; want 2 naming nope.json", code, stderr.String())
	}
}

func TestConnErrorsHideSecrets(t *testing.T) {
	srv := natstest.Start(t, func(o *server.Options) {
		o.Users = []*server.User{{Username: "mapper", Password: "right-password"}}
	})
	writeContext(t, "none", map[string]any{})
	t.Setenv("NATS_PASSWORD", secret)
	for name, args := range map[string][]string{
		"password":  {"--server", srv.URL(), "--user", "mapper"},
		"token":     {"--server", srv.URL(), "--token", secret},
		"url":       {"--server", strings.Replace(srv.URL(), "nats://", "nats://mapper:"+secret+"@", 1)},
		"context":   {"--server", srv.URL(), "--context", "none", "--user", "mapper"},
		"no server": {"--server", "nats://mapper:" + secret + "@127.0.0.1:1", "--connect-timeout", "200ms"},
	} {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := Main(append([]string{"kvmapper", "setup", "--log-format", "json"}, args...), &stdout, &stderr, Build{})
			if code != 1 {
				t.Errorf("setup %v: exit %d, want 1; stderr %q", args, code, stderr.String())
			}
			if name != "no server" && !strings.Contains(stderr.String(), "authorization violation: the server refused") {
				t.Errorf("setup %v: stderr %q does not say authorization violation", args, stderr.String())
			}
			if strings.Contains(stderr.String()+stdout.String(), secret) {
				t.Errorf("setup %v printed the secret: %q", args, stderr.String())
			}
		})
	}
	// Help shows no value read from the environment.
	var stdout, stderr bytes.Buffer
	if code := Main([]string{"kvmapper", "run", "--help"}, &stdout, &stderr, Build{}); code != 0 || strings.Contains(stdout.String(), secret) {
		t.Errorf("run --help with NATS_PASSWORD set: exit %d, shows the secret: %v", code, strings.Contains(stdout.String(), secret))
	}
}
