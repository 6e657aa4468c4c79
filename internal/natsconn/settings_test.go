package natsconn_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/natsconn"
)

func ptr[T any](v T) *T { return &v }

func TestOverridesOver(t *testing.T) {
	base := natsconn.Settings{URL: "nats://ctx:4222", User: "alice", Password: secret, UserJWT: "jwt", UserSeed: secret,
		CA: "ca.pem", TLSFirst: true, InboxPrefix: "_INBOX_ctx", ContextPath: "/ctx.json"}
	for _, tc := range []struct {
		name string
		o    natsconn.Overrides
		want func(s *natsconn.Settings) // applied to a copy of base
	}{
		{"none", natsconn.Overrides{}, func(*natsconn.Settings) {}},
		{"url keeps the identity", natsconn.Overrides{URL: ptr("nats://flag:4222")}, func(s *natsconn.Settings) {
			s.URL = "nats://flag:4222"
		}},
		{"creds replace the whole identity", natsconn.Overrides{Creds: ptr("u.creds")}, func(s *natsconn.Settings) {
			s.User, s.Password, s.UserJWT, s.UserSeed, s.Creds = "", "", "", "", "u.creds"
		}},
		{"an empty token replaces it too", natsconn.Overrides{Token: ptr("")}, func(s *natsconn.Settings) {
			s.User, s.Password, s.UserJWT, s.UserSeed = "", "", "", ""
		}},
		{"user and password", natsconn.Overrides{User: ptr("bob"), Password: ptr("pw")}, func(s *natsconn.Settings) {
			s.User, s.Password, s.UserJWT, s.UserSeed = "bob", "pw", "", ""
		}},
		{"password alone replaces only the password", natsconn.Overrides{Password: ptr("other")}, func(s *natsconn.Settings) {
			s.Password = "other"
		}},
		{"false and empty clear", natsconn.Overrides{TLSFirst: ptr(false), InboxPrefix: ptr(""), CA: ptr("")}, func(s *natsconn.Settings) {
			s.TLSFirst, s.InboxPrefix, s.CA = false, "", ""
		}},
		{"client certificate", natsconn.Overrides{Cert: ptr("c.pem"), Key: ptr("k.pem")}, func(s *natsconn.Settings) {
			s.Cert, s.Key = "c.pem", "k.pem"
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := base
			tc.want(&want)
			if got := tc.o.Over(base); got != want {
				t.Errorf("Over() = %+v, want %+v", got, want)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	creds, notSeed := touch(t, "user.creds"), touch(t, "user.nk")
	ok := natsconn.Settings{URL: "nats://127.0.0.1:4222", ConnectTimeout: time.Second, ReconnectWait: time.Second}
	for _, tc := range []struct {
		name string
		set  func(s *natsconn.Settings)
		want []string // nil: valid
	}{
		{"no credentials", func(*natsconn.Settings) {}, nil},
		{"user and password", func(s *natsconn.Settings) { s.User, s.Password = "u", secret }, nil},
		{"lone user, read as a token", func(s *natsconn.Settings) { s.User = secret }, nil},
		{"password left over beside creds", func(s *natsconn.Settings) { s.Creds, s.Password = creds, secret }, nil},
		{"password for the URL's user", func(s *natsconn.Settings) { s.URL, s.Password = "nats://u@127.0.0.1:4222", secret }, nil},
		{"two identities", func(s *natsconn.Settings) { s.User, s.Password, s.Token = "u", "p", secret },
			[]string{"give one of --creds, --nkey, --user/--password or --token", `user "u" with a password`, "a token"}},
		{"lone user beside a token", func(s *natsconn.Settings) { s.User, s.Token = "u", secret }, []string{"give one of"}},
		{"password alone", func(s *natsconn.Settings) { s.Password = secret }, []string{"--password needs --user"}},
		{"cert without key", func(s *natsconn.Settings) { s.Cert = creds }, []string{"give --tlscert and --tlskey together"}},
		{"missing file", func(s *natsconn.Settings) { s.Creds, s.ContextPath = "/no/such.creds", "/ctx.json" },
			[]string{`invalid value "/no/such.creds" for flag --creds (or the context /ctx.json)`, "no such file"}},
		{"missing CA", func(s *natsconn.Settings) { s.CA = "/no/ca.pem" }, []string{"flag --tlsca"}},
		{"not a seed", func(s *natsconn.Settings) { s.NKey = notSeed }, []string{"flag --nkey", "not an NKey seed file"}},
		{"zero timeout", func(s *natsconn.Settings) { s.ConnectTimeout = 0 },
			[]string{"invalid value for flag --connect-timeout or --reconnect-wait: must be positive"}},
		{"negative wait", func(s *natsconn.Settings) { s.ReconnectWait = -time.Second }, []string{"must be positive"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := ok
			tc.set(&s)
			err := s.Validate()
			if tc.want == nil {
				if err != nil {
					t.Errorf("Validate() = %v, want nil", err)
				}
				return
			}
			if !errors.Is(err, natsconn.ErrInvalid) {
				t.Fatalf("Validate() = %v, want an error that is ErrInvalid", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate() = %q, does not say %q", err, w)
				}
			}
			if strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "natsconn:") {
				t.Errorf("Validate() = %q shows the secret or the sentinel's text", err)
			}
		})
	}
}
