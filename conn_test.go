package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v2"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// secret is the password, token or seed the tests hide; it must never appear in output.
const secret = "hunter2-s3cret"

// settingsFor parses args (after the program name) with the connection flags and returns
// connSettingsFrom's result.
func settingsFor(t *testing.T, args ...string) (connSettings, error) {
	t.Helper()
	var s connSettings
	var err error
	app := &cli.App{Flags: connFlags(), Writer: &bytes.Buffer{}, ErrWriter: &bytes.Buffer{},
		Action: func(c *cli.Context) error {
			s, err = connSettingsFrom(c)
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
		t.Fatalf("connSettingsFrom: %v", err)
	}
	want := connSettings{URL: "nats://a:4222,nats://b:4222", Token: secret, CA: ca, InboxPrefix: "_INBOX_kvmapper", TLSFirst: true,
		ConnectTimeout: 2 * time.Second, ReconnectWait: 250 * time.Millisecond, Context: path}
	if s != want {
		t.Errorf("connSettingsFrom() = %+v, want %+v", s, want)
	}
	// The environment variable the nats CLI reads names the context too; a .json path works.
	t.Setenv("NATS_CONTEXT", path)
	if s, err := settingsFor(t); err != nil || s.URL != want.URL {
		t.Errorf("NATS_CONTEXT=%s: URL %q, err %v; want %q", path, s.URL, err, want.URL)
	}
}

func TestConnFlagsOverrideContext(t *testing.T) {
	creds := touch(t, "user.creds")
	writeContext(t, "dev", map[string]any{"url": "nats://ctx:4222", "user": "alice", "password": "data:;base64," + base64.StdEncoding.EncodeToString([]byte(secret))})
	for _, tc := range []struct {
		name string
		args []string
		want func(connSettings) error
	}{
		{"context alone", nil, func(s connSettings) error {
			if s.URL != "nats://ctx:4222" || s.User != "alice" || s.Password != secret {
				return errors.New("want the context's url, user and decoded password")
			}
			return nil
		}},
		{"server flag", []string{"--server", "nats://flag:4222"}, func(s connSettings) error {
			if s.URL != "nats://flag:4222" || s.User != "alice" {
				return errors.New("want the flag's URL and the context's user")
			}
			return nil
		}},
		{"creds flag replaces the identity", []string{"--creds", creds}, func(s connSettings) error {
			if s.Creds != creds || s.User != "" || s.Password != "" {
				return errors.New("want the creds file only")
			}
			return nil
		}},
		{"password flag replaces the password", []string{"--password", "other"}, func(s connSettings) error {
			if s.User != "alice" || s.Password != "other" {
				return errors.New("want alice with the flag's password")
			}
			return nil
		}},
		{"lone user is a token, as in the nats CLI", []string{"--user", "tok"}, func(s connSettings) error {
			if s.Token != "tok" || s.User != "" {
				return errors.New("want token tok")
			}
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := settingsFor(t, append([]string{"--context", "dev"}, tc.args...)...)
			if err != nil {
				t.Fatalf("connSettingsFrom: %v", err)
			}
			if err := tc.want(s); err != nil {
				t.Errorf("connSettingsFrom() = %+v: %v", s, err)
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

func TestConnContextErrors(t *testing.T) {
	path := writeContext(t, "odd", map[string]any{"url": "nats://x:4222", "password": secret})
	for _, tc := range []struct {
		name    string
		context any
		args    []string
		want    []string
	}{
		{"missing", nil, []string{"--context", "nope"}, []string{filepath.Join(filepath.Dir(path), "nope.json"), "does not exist", "nats context save"}},
		{"path in name", nil, []string{"--context", "../etc/x"}, []string{"path separators"}},
		{"bad json", `{"password": "` + secret + `", `, []string{"--context", "ctx"}, []string{"invalid JSON"}},
		{"op reference", map[string]any{"token": "op://vault/" + secret}, []string{"--context", "ctx"}, []string{"token", "op://", "env://NAME"}},
		{"unset env", map[string]any{"password": "env://NO_SUCH_VAR_X", "user": "u"}, []string{"--context", "ctx"}, []string{"NO_SUCH_VAR_X", "not set"}},
		{"domain", map[string]any{"jetstream_domain": "hub"}, []string{"--context", "ctx"}, []string{"JetStream domain", "does not support"}},
		{"creds from env", map[string]any{"creds": "env://X"}, []string{"--context", "ctx"}, []string{"only from a file"}},
		{"two identities", nil, []string{"--user", "u", "--password", "p", "--token", secret}, []string{"give one of", `user "u"`, "a token"}},
		{"missing creds file", nil, []string{"--creds", "/no/such.creds"}, []string{"--creds", "/no/such.creds", "no such file"}},
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
				t.Fatalf("connSettingsFrom(%v) = nil error, want one saying %q", tc.args, tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("connSettingsFrom(%v) error %q does not say %q", tc.args, err, w)
				}
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
	code := realMain([]string{"kvmapper", "setup", "--context", "nope"}, &stdout, &stderr)
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
			code := realMain(append([]string{"kvmapper", "setup", "--log-format", "json"}, args...), &stdout, &stderr)
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
	if code := realMain([]string{"kvmapper", "run", "--help"}, &stdout, &stderr); code != 0 || strings.Contains(stdout.String(), secret) {
		t.Errorf("run --help with NATS_PASSWORD set: exit %d, shows the secret: %v", code, strings.Contains(stdout.String(), secret))
	}
}

func TestConnPermissionViolationLog(t *testing.T) {
	var buf bytes.Buffer
	log := zerolog.New(&buf)
	limit := &logLimiter{every: time.Hour}
	for i := range 100 {
		err := fmt.Errorf("%w: Permissions Violation for Publish to %q", nats.ErrPermissionViolation, fmt.Sprintf("outgoing.g.dev-%d.evt", i))
		asyncError(log, limit, nil, err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 1 {
		t.Fatalf("100 violations logged %d lines, want 1 within the interval:\n%s", len(lines), buf.String())
	}
	var l map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &l); err != nil {
		t.Fatal(err)
	}
	if l["grant"] != "outgoing.>" || l["operation"] != "publish" || l["subject"] != "outgoing.g.dev-0.evt" {
		t.Errorf("violation logged as %v, want operation publish, subject outgoing.g.dev-0.evt, grant outgoing.>", l)
	}
	if !strings.Contains(l["message"].(string), `grant it publish on "outgoing.>"`) {
		t.Errorf("message %q does not say what to grant", l["message"])
	}
}

func TestConnLogLimiter(t *testing.T) {
	l := &logLimiter{every: time.Second}
	t0 := time.Now()
	for i, step := range []struct {
		at         time.Duration
		kind       string
		ok         bool
		suppressed int
	}{
		{0, "a", true, 0},
		{100 * time.Millisecond, "a", false, 0},
		{200 * time.Millisecond, "a", false, 0},
		{300 * time.Millisecond, "b", true, 0},
		{1100 * time.Millisecond, "a", true, 2},
		{1200 * time.Millisecond, "a", false, 0},
	} {
		n, ok := l.allowAt(step.kind, t0.Add(step.at))
		if ok != step.ok || n != step.suppressed {
			t.Errorf("step %d: allowAt(%s, +%v) = %d, %v; want %d, %v", i, step.kind, step.at, n, ok, step.suppressed, step.ok)
		}
	}
}

func TestConnGrantFor(t *testing.T) {
	for subject, want := range map[string]string{
		"outgoing.g.dev.evt": "outgoing.>",
		"$JS.API.CONSUMER.CREATE.INCOMING.abc.incoming.3.>":        "$JS.API.CONSUMER.CREATE.INCOMING.>",
		"$JS.API.CONSUMER.CREATE.KV_kvmapper.abc":                  "$JS.API.CONSUMER.CREATE.KV_kvmapper.>",
		"$JS.API.CONSUMER.MSG.NEXT.INCOMING.abc":                   "$JS.API.CONSUMER.MSG.NEXT.INCOMING.*",
		"$JS.API.CONSUMER.DELETE.INCOMING.abc":                     "$JS.API.CONSUMER.DELETE.INCOMING.*",
		"$JS.API.DIRECT.GET.KV_kvmapper.$KV.kvmapper.checkpoint.3": "$JS.API.DIRECT.GET.KV_kvmapper.>",
		"$JS.API.STREAM.INFO.INCOMING":                             "$JS.API.STREAM.INFO.INCOMING",
		"$KV.kvmapper.lease.3":                                     "$KV.kvmapper.>",
		"$JS.FC.KV_device-groups.abc.1":                            "$JS.FC.KV_device-groups.>",
		"$SRV.PING.kvmapper":                                       "$SRV.>",
		"_INBOX.abc.def":                                           "_INBOX.>",
		"kvmapper.status.kvmapper.m1":                              "kvmapper.status.kvmapper.*",
		"kvmapper.events.ownership":                                "kvmapper.events.ownership",
	} {
		if got := grantFor(subject); got != want {
			t.Errorf("grantFor(%q) = %q, want %q", subject, got, want)
		}
	}
}

func TestConnRedactURLs(t *testing.T) {
	got := redactURLs("nats://u:" + secret + "@a:4222, nats://" + secret + "@b:4222,nats://c:4222")
	if strings.Contains(got, secret) || !strings.Contains(got, "nats://c:4222") {
		t.Errorf("redactURLs() = %q", got)
	}
}
