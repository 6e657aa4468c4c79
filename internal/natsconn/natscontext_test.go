package natsconn_test

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/internal/natsconn"
)

// secret is the password, token or seed the tests hide; it must never appear in output.
const secret = "hunter2-s3cret"

// writeContext writes a nats CLI context under a fresh XDG_CONFIG_HOME and returns its path.
func writeContext(t *testing.T, name string, ctx map[string]any) string {
	t.Helper()
	home := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", home)
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

// touch writes a file of one byte under a temporary directory and returns its path.
func touch(t *testing.T, name string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadContext(t *testing.T) {
	ca := touch(t, "ca.pem")
	t.Setenv("CA_DIR", filepath.Dir(ca))
	t.Setenv("CTX_TOKEN", secret)
	path := writeContext(t, "prod", map[string]any{
		"url": "nats://a:4222,nats://b:4222", "token": "env://CTX_TOKEN", "ca": "$CA_DIR/ca.pem",
		"user_seed":    "data:;base64," + base64.StdEncoding.EncodeToString([]byte(secret+"\n")),
		"inbox_prefix": "_INBOX_kvmapper", "tls_first": true, "description": "ignored",
	})
	want := natsconn.Settings{URL: "nats://a:4222,nats://b:4222", Token: secret, UserSeed: secret, CA: ca,
		InboxPrefix: "_INBOX_kvmapper", TLSFirst: true, ContextPath: path}
	for _, name := range []string{"prod", path} {
		s, err := natsconn.LoadContext(name)
		if err != nil {
			t.Fatalf("LoadContext(%q): %v", name, err)
		}
		if s != want {
			t.Errorf("LoadContext(%q) = %+v, want %+v", name, s, want)
		}
	}
}

func TestLoadContextErrors(t *testing.T) {
	path := writeContext(t, "odd", map[string]any{"url": "nats://x:4222", "password": secret})
	for _, tc := range []struct {
		name    string
		context any // file contents: a string as is, a map as JSON, nil for no file
		load    string
		want    []string
		invalid bool // errors.Is(err, ErrInvalid)
	}{
		{"missing", nil, "nope", []string{filepath.Join(filepath.Dir(path), "nope.json"), "does not exist", "nats context save"}, true},
		{"path in name", nil, "../etc/x", []string{`invalid value "../etc/x" for flag --context`, "path separators"}, true},
		{"bad json", `{"password": "` + secret + `", `, "ctx", []string{"invalid JSON at byte"}, false},
		{"not a context", `["` + secret + `"]`, "ctx", []string{"not a nats context file"}, false},
		{"op reference", map[string]any{"token": "op://vault/" + secret}, "ctx", []string{"field token", "op://", "env://NAME"}, false},
		{"unset env", map[string]any{"password": "env://NO_SUCH_VAR_X", "user": "u"}, "ctx", []string{"NO_SUCH_VAR_X", "not set"}, false},
		{"bad data", map[string]any{"password": "data:;base64,!" + secret}, "ctx", []string{"not valid base64"}, false},
		{"nsc", map[string]any{"nsc": "nsc://op/acc/" + secret}, "ctx", []string{"sets nsc", "nsc generate creds"}, false},
		{"domain", map[string]any{"jetstream_domain": "hub"}, "ctx", []string{"JetStream domain", "does not support"}, false},
		{"socks", map[string]any{"socks_proxy": "socks5://p:1080"}, "ctx", []string{"socks_proxy", "does not support"}, false},
		{"creds from env", map[string]any{"creds": "env://X"}, "ctx", []string{"field creds", "only from a file"}, false},
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
			_, err := natsconn.LoadContext(tc.load)
			if err == nil {
				t.Fatalf("LoadContext(%q) = nil error, want one saying %q", tc.load, tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("LoadContext(%q) error %q does not say %q", tc.load, err, w)
				}
			}
			if got := errors.Is(err, natsconn.ErrInvalid); got != tc.invalid {
				t.Errorf("errors.Is(%q, ErrInvalid) = %v, want %v", err, got, tc.invalid)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("LoadContext(%q) error %q shows the secret", tc.load, err)
			}
		})
	}
}
