package natsconn

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
)

// natsContext is the part of a nats CLI context file (natscontext in jsm.go) that kvmapper reads.
type natsContext struct {
	URL, Token, User, Password, Creds, NKey, Cert, Key, CA string
	NSC                                                    string `json:"nsc"`
	JSDomain                                               string `json:"jetstream_domain"`
	JSAPIPrefix                                            string `json:"jetstream_api_prefix"`
	InboxPrefix                                            string `json:"inbox_prefix"`
	UserJWT                                                string `json:"user_jwt"`
	UserSeed                                               string `json:"user_seed"`
	TLSFirst                                               bool   `json:"tls_first"`
	SocksProxy                                             string `json:"socks_proxy"`
	WinCertStore                                           string `json:"windows_cert_store"`
}

// contextPath returns the file the nats CLI keeps context name in: a .json path that exists is
// taken as is, as the nats CLI does.
func contextPath(name string) (string, error) {
	if strings.HasSuffix(name, ".json") {
		if _, err := os.Stat(name); err == nil {
			return name, nil
		}
	}
	if name == "." || name == ".." || strings.ContainsAny(name, `/\`) {
		return "", invalidf("invalid value %q for flag --context: a context name has no path separators (or give an existing .json file)", name)
	}
	root := os.Getenv("XDG_CONFIG_HOME")
	if root == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("finding nats context %q: %w (set XDG_CONFIG_HOME)", name, err)
		}
		root = filepath.Join(home, ".config")
	}
	return filepath.Join(root, "nats", "context", name+".json"), nil
}

// LoadContext reads the nats CLI context name: one saved by `nats context save` (under
// $XDG_CONFIG_HOME/nats/context, by default ~/.config/nats/context), or an existing .json file.
// It resolves env:// and data: references and expands file paths as the nats CLI does, and sets
// ContextPath; the timeouts are left zero. The error wraps [ErrInvalid] if name names no context
// file. A context that asks for what kvmapper does not support (nsc lookups, a JetStream domain
// or API prefix, a SOCKS proxy, a Windows certificate store) is an error that says so. Errors
// never contain the file's secrets.
func LoadContext(name string) (Settings, error) {
	path, err := contextPath(name)
	if err != nil {
		return Settings{}, err
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return Settings{}, invalidf("invalid value %q for flag --context: %s does not exist (list contexts with `nats context ls`, create one with `nats context save %s --server URL …`)", name, path, name)
	}
	if err != nil {
		return Settings{}, fmt.Errorf("reading nats context %q: %w", name, err)
	}
	var nc natsContext
	if err := json.Unmarshal(b, &nc); err != nil {
		// The JSON error may quote the file, and the file holds secrets: name only the position.
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return Settings{}, fmt.Errorf("reading nats context %s: invalid JSON at byte %d", path, se.Offset)
		}
		return Settings{}, fmt.Errorf("reading nats context %s: not a nats context file", path)
	}
	unsupported := func(field, what string) error {
		return fmt.Errorf("nats context %s sets %s, which kvmapper does not support: %s", path, field, what)
	}
	switch {
	case nc.NSC != "":
		return Settings{}, unsupported("nsc", "export the user's credentials (nsc generate creds) and set creds to that file")
	case nc.JSDomain != "" || nc.JSAPIPrefix != "":
		return Settings{}, unsupported("a JetStream domain or API prefix", "connect in the account that holds the streams")
	case nc.SocksProxy != "":
		return Settings{}, unsupported("socks_proxy", "reach the server directly")
	case nc.WinCertStore != "":
		return Settings{}, unsupported("a Windows certificate store", "use cert, key and ca files")
	}
	s := Settings{URL: nc.URL, User: nc.User, InboxPrefix: nc.InboxPrefix, TLSFirst: nc.TLSFirst, ContextPath: path}
	for _, f := range []struct {
		field, from string
		to          *string
		filePath    bool
	}{
		{"password", nc.Password, &s.Password, false},
		{"token", nc.Token, &s.Token, false},
		{"user_jwt", nc.UserJWT, &s.UserJWT, false},
		{"user_seed", nc.UserSeed, &s.UserSeed, false},
		{"creds", nc.Creds, &s.Creds, true},
		{"nkey", nc.NKey, &s.NKey, true},
		{"cert", nc.Cert, &s.Cert, true},
		{"key", nc.Key, &s.Key, true},
		{"ca", nc.CA, &s.CA, true},
	} {
		v, err := resolveRef(f.from, f.filePath)
		if err != nil {
			return Settings{}, fmt.Errorf("nats context %s, field %s: %w", path, f.field, err)
		}
		*f.to = v
	}
	return s, nil
}

// resolveRef resolves a context value the way natscontext does: file paths expand ~ and $VAR and
// may be file:// URIs; other values may be env://NAME or data:;base64,… references. Errors never
// contain the value.
func resolveRef(v string, filePath bool) (string, error) {
	if v == "" {
		return "", nil
	}
	scheme := ""
	if u, err := url.Parse(v); err == nil && len(u.Scheme) >= 2 { // one letter is a Windows drive
		scheme = strings.ToLower(u.Scheme)
	}
	rest := v
	if scheme != "" {
		rest = v[len(scheme)+1:]
	}
	switch {
	case filePath && (scheme == "" || scheme == "file"):
		p := os.ExpandEnv(strings.TrimPrefix(rest, "//"))
		if strings.HasPrefix(p, "~") {
			if home, err := os.UserHomeDir(); err == nil {
				p = home + p[1:]
			}
		}
		return p, nil
	case filePath:
		return "", fmt.Errorf("kvmapper reads it only from a file (a path or file:// URI), not a %s: reference", scheme)
	case scheme == "env":
		name := strings.TrimPrefix(rest, "//")
		val, ok := os.LookupEnv(name)
		if !ok || val == "" {
			return "", fmt.Errorf("environment variable %s it refers to is not set", name)
		}
		return val, nil
	case scheme == "data":
		header, payload, ok := strings.Cut(rest, ",")
		if !ok || !strings.Contains(header, ";base64") {
			return "", errors.New("a data: reference must be data:;base64,…")
		}
		b, err := base64.StdEncoding.DecodeString(payload)
		if err != nil {
			return "", errors.New("the data: reference is not valid base64")
		}
		return strings.TrimRight(string(b), "\r\n"), nil
	case scheme == "op" || scheme == "nsc":
		return "", fmt.Errorf("kvmapper cannot resolve %s:// references: put the value in an environment variable and use env://NAME", scheme)
	default:
		return v, nil
	}
}
