package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// grants are the NATS permissions one kvmapper command needs, found by running each command
// against a server that allowed nothing else (and by tracing what it sends). They use the
// default names; each stream, bucket and subject is a flag, so substitute yours. This is the
// single source of docs/security.md's "Least privilege" section: change both together.
type grants struct {
	Publish   []string
	Subscribe []string
	// Responses lets the user answer requests on their reply subjects (the server's
	// allow_responses, one reply per request): the replica's status service needs it.
	Responses bool
}

var (
	// replicaGrants are what `kvmapper run` needs once the streams and buckets exist.
	replicaGrants = grants{
		Publish: []string{
			// setup's checks, and opening the buckets
			"$JS.API.STREAM.INFO.INCOMING", "$JS.API.STREAM.INFO.OUTGOING", "$JS.API.STREAM.INFO.UNMAPPED",
			"$JS.API.STREAM.INFO.KV_device-groups", "$JS.API.STREAM.INFO.KV_kvmapper",
			// one ordered (ephemeral, AckNone) consumer per owned partition; recreated on reset
			"$JS.API.CONSUMER.CREATE.INCOMING.>", "$JS.API.CONSUMER.MSG.NEXT.INCOMING.*", "$JS.API.CONSUMER.DELETE.INCOMING.*",
			// the groups table's watch, and the election's watch of the control bucket (ordered
			// push consumers: $JS.FC answers the server's flow control when a watch has a backlog)
			"$JS.API.CONSUMER.CREATE.KV_device-groups.>", "$JS.API.CONSUMER.DELETE.KV_device-groups.*", "$JS.FC.KV_device-groups.>",
			"$JS.API.CONSUMER.CREATE.KV_kvmapper.>", "$JS.API.CONSUMER.DELETE.KV_kvmapper.*", "$JS.FC.KV_kvmapper.>",
			// leases, members, checkpoints: read, create, update, delete; and what a
			// compare-and-set ran into, read from the bucket's leader
			"$JS.API.DIRECT.GET.KV_kvmapper.>", "$KV.kvmapper.>", "$JS.API.STREAM.MSG.GET.KV_kvmapper",
			// the work, and the ownership events (--events-subject)
			"outgoing.>", "unmapped.>", "kvmapper.events.ownership",
			// on a cluster: a partition's fence records in the output streams, written by
			// compare-and-set on the last one, read from each stream's leader
			"kvmapper.fence.>", "$JS.API.STREAM.MSG.GET.OUTGOING", "$JS.API.STREAM.MSG.GET.UNMAPPED",
			// a lane whose consumer has been quiet for 3 s asks INCOMING's leader
			// whether it holds messages the consumer has not delivered (lanes/wait.go)
			"$JS.API.STREAM.MSG.GET.INCOMING",
		},
		Subscribe: []string{
			"_INBOX.>", // replies and consumer deliveries (--inbox-prefix names another)
			// the output streams' new leaders, announced: what the old one dropped is resent at once
			"$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.*",
			// the status micro service: kvmapper status and nats micro ls|info|stats
			"kvmapper.status.kvmapper.*", "$SRV.*", "$SRV.*.kvmapper", "$SRV.*.kvmapper.*",
		},
		Responses: true,
	}
	// setupGrants are what `kvmapper setup` (or a first `kvmapper run`) needs to create them;
	// creating a bucket reads the account's JetStream info.
	// With --layout auto on a server with no deployment yet, setup looks for the first partition
	// stream, then probes the account mapping: one message to a device subject, which it
	// receives itself as it was published or as the mapping delivers it.
	setupGrants = grants{
		Publish: append(slices.Clone(replicaGrants.Publish), "$JS.API.INFO",
			"$JS.API.STREAM.CREATE.INCOMING", "$JS.API.STREAM.CREATE.OUTGOING", "$JS.API.STREAM.CREATE.UNMAPPED",
			"$JS.API.STREAM.CREATE.KV_device-groups", "$JS.API.STREAM.CREATE.KV_kvmapper",
			"$JS.API.STREAM.INFO.INCOMING-0", "incoming.kvmapper-probe-0.probe"),
		Subscribe: []string{"_INBOX.>", "incoming.kvmapper-probe-0.probe", "incoming.*.kvmapper-probe-0.probe"},
	}
	// statusGrants are what `kvmapper status` needs.
	statusGrants = grants{
		Publish: []string{
			"$JS.API.STREAM.INFO.INCOMING", "$JS.API.STREAM.INFO.KV_device-groups", "$JS.API.STREAM.INFO.KV_kvmapper",
			// the layout setup recorded (--layout auto)
			"$JS.API.DIRECT.GET.KV_kvmapper.$KV.kvmapper.layout",
			// each stream's leader and followers
			"$JS.API.STREAM.INFO.OUTGOING", "$JS.API.STREAM.INFO.UNMAPPED",
			"$JS.API.CONSUMER.CREATE.KV_kvmapper.>", "$JS.API.CONSUMER.DELETE.KV_kvmapper.*", "$JS.FC.KV_kvmapper.>",
			// lag of a partition whose owner does not answer: a consumer's pending count
			"$JS.API.CONSUMER.CREATE.INCOMING.>", "$JS.API.CONSUMER.DELETE.INCOMING.*",
			"kvmapper.status.kvmapper.*",
		},
		Subscribe: []string{"_INBOX.>"},
	}
	// verifyGrants are what `kvmapper verify` needs.
	verifyGrants = grants{
		Publish: []string{
			"$JS.API.STREAM.INFO.INCOMING", "$JS.API.STREAM.INFO.OUTGOING", "$JS.API.STREAM.INFO.UNMAPPED",
			"$JS.API.STREAM.INFO.KV_kvmapper", "$JS.API.DIRECT.GET.KV_kvmapper.$KV.kvmapper.layout",
			"$JS.API.CONSUMER.CREATE.OUTGOING.>", "$JS.API.CONSUMER.MSG.NEXT.OUTGOING.*", "$JS.API.CONSUMER.DELETE.OUTGOING.*",
			"$JS.API.CONSUMER.CREATE.UNMAPPED.>", "$JS.API.CONSUMER.MSG.NEXT.UNMAPPED.*", "$JS.API.CONSUMER.DELETE.UNMAPPED.*",
			// The mapping check: each revision OUTGOING's messages name, read by sequence.
			"$JS.API.STREAM.INFO.KV_device-groups", "$JS.API.DIRECT.GET.KV_device-groups",
		},
		Subscribe: []string{"_INBOX.>"},
	}
)

func (g grants) permissions() *server.Permissions {
	p := &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: g.Publish},
		Subscribe: &server.SubjectPermission{Allow: g.Subscribe},
	}
	if g.Responses {
		p.Response = &server.ResponsePermission{MaxMsgs: 1, Expires: time.Minute}
	}
	return p
}

// withInbox replaces the _INBOX.> subscription with prefix.>, for a process run with
// --inbox-prefix prefix.
func (g grants) withInbox(prefix string) grants {
	g.Subscribe = slices.Clone(g.Subscribe)
	g.Subscribe[slices.Index(g.Subscribe, "_INBOX.>")] = prefix + ".>"
	return g
}

func (g grants) without(subject string) grants {
	g.Publish = slices.DeleteFunc(slices.Clone(g.Publish), func(s string) bool { return s == subject })
	return g
}

// users configures one user per command plus an unrestricted admin; each password is the user
// name followed by "-pw".
func users(byName map[string]grants) func(*server.Options) {
	return func(o *server.Options) {
		o.Users = []*server.User{{Username: "admin", Password: "admin-pw"}}
		for name, g := range byName {
			o.Users = append(o.Users, &server.User{Username: name, Password: name + "-pw", Permissions: g.permissions()})
		}
	}
}

// violations returns the permissions-violation lines a mapper logged.
func violations(m *mapper) []map[string]any {
	var out []map[string]any
	for _, l := range m.logs.lines() {
		if s, _ := l["message"].(string); strings.Contains(s, "permissions violation") {
			out = append(out, l)
		}
	}
	return out
}

func TestSecurityLeastPrivilegeEndToEnd(t *testing.T) {
	srv := natstest.Start(t, users(map[string]grants{
		"setup": setupGrants, "mapper": replicaGrants, "status": statusGrants, "verify": verifyGrants,
	}))
	// setup as its restricted user creates everything on an empty server.
	out, errOut, code := runCLI(t, "setup", "--server", srv.URL(), "--user", "setup", "--password", "setup-pw")
	if code != 0 || strings.Count(out, "created") != 5 {
		t.Fatalf("setup with setupGrants: exit %d, want 0 and five created:\n%s%s", code, out, errOut)
	}
	e := envOn(t, srv, nats.UserInfo("admin", "admin-pw"))
	devices := deviceNames("sec", 20)
	want := map[string]int{}
	for i, d := range devices {
		if i%4 != 0 { // every fourth device has no group: it exercises UNMAPPED
			e.put(d, "group-"+d[len(d)-1:])
		}
	}
	as := func(user string) []string { return []string{"--user", user, "--password", user + "-pw"} }
	m := e.startMapper("m1", as("mapper")...)
	l := newLoad(t, e.js)
	l.publish(devices, 50)
	// A server restart resets every ordered consumer: the replica deletes and recreates them.
	e.srv = e.srv.Restart()
	m.waitLog("reconnected to NATS", 30*time.Second)
	l.publish(devices, 50)
	for _, d := range devices {
		want[d] = l.next[d]
	}
	total := l.total()
	outgoing := e.readStream("OUTGOING", total*3/4, 60*time.Second)
	unmapped := e.readStream("UNMAPPED", total/4, 60*time.Second)
	perDevice(t, append(outgoing, unmapped...), want)

	for _, cmd := range []string{"status", "verify"} {
		out, errOut, code := runCLI(t, append([]string{cmd, "--server", e.srv.URL(), "--log-format", "json"}, as(cmd)...)...)
		if code != 0 || strings.Contains(errOut, "permissions violation") {
			t.Errorf("kvmapper %s with %sGrants: exit %d, want 0 and no violation:\n%s%s", cmd, cmd, code, out, errOut)
		}
		if cmd == "verify" && !strings.Contains(out, "as the value each was mapped with renders it") {
			t.Errorf("kvmapper verify with verifyGrants checked no message against its value:\n%s%s", out, errOut)
		}
	}
	m.stop() // releasing partitions: final checkpoints, lease and member deletes
	if v := violations(m); len(v) > 0 {
		t.Errorf("a replica with replicaGrants hit %d permissions violations, first: %v", len(v), v[0])
	}
	if strings.Contains(m.logs.String(), "mapper-pw") {
		t.Error("the mapper's logs contain its password")
	}
}

func TestSecurityPermissionViolationIsReportedOncePerSecondAndRetried(t *testing.T) {
	// The mapper's own inbox prefix keeps it from reading other clients' replies.
	granted := replicaGrants.withInbox("_INBOX_kvmapper")
	srv := natstest.Start(t, users(map[string]grants{"mapper": granted.without("outgoing.>")}))
	e := envOn(t, srv, nats.UserInfo("admin", "admin-pw"))
	devices := deviceNames("deny", 10)
	for _, d := range devices {
		e.put(d, "g")
	}
	m := e.startMapper("m1", "--user", "mapper", "--password", "mapper-pw", "--inbox-prefix", "_INBOX_kvmapper")
	l := newLoad(t, e.js)
	l.publish(devices, 100)

	// The mapper names the subject and the permission to grant, at most once a second.
	start := time.Now()
	first := m.waitLog("permissions violation", 20*time.Second)
	if first["grant"] != "outgoing.>" || first["operation"] != "publish" || !strings.HasPrefix(first["subject"].(string), "outgoing.g.deny") {
		t.Errorf("violation logged as %v; want operation publish, subject outgoing.g.deny…, grant outgoing.>", first)
	}
	natstest.Eventually(t, 20*time.Second, func() error {
		if n := len(violations(m)); n < 3 {
			return fmt.Errorf("%d violation lines so far, waiting for 3", n)
		}
		return nil
	})
	elapsed := time.Since(start)
	if n, most := len(violations(m)), int(elapsed/time.Second)+2; n > most {
		t.Errorf("%d violation lines in %v, want at most %d (one a second)", n, elapsed, most)
	}
	// Everything else the mapper says about it (the lanes' retries) is rate-limited too.
	var loud []string
	for _, l := range m.logs.lines() {
		if l["level"] == "warn" || l["level"] == "error" {
			loud = append(loud, fmt.Sprint(l["message"]))
		}
	}
	if most := 5 * (int(elapsed/time.Second) + 2); len(loud) > most {
		t.Errorf("%d warnings and errors in %v, want at most %d: the mapper floods its log:\n%s", len(loud), elapsed, most, strings.Join(loud, "\n"))
	}
	select {
	case <-m.done:
		t.Fatalf("mapper exited (%v) on a permissions violation; want it to keep retrying", m.err)
	default:
	}

	// Granting the permission (a configuration reload) resumes the work: nothing lost or reordered.
	opts := *e.srv.Opts
	users(map[string]grants{"mapper": granted})(&opts)
	if err := e.srv.ReloadOptions(&opts); err != nil {
		t.Fatalf("ReloadOptions: %v", err)
	}
	want := each(devices, 100)
	perDevice(t, e.readStream("OUTGOING", l.total(), 60*time.Second), want)
	m.stop()
	for _, v := range violations(m) {
		if v["grant"] != "outgoing.>" {
			t.Errorf("violation other than outgoing.>: %v", v)
		}
	}
}

func TestSecurityTLSNeedsTheCA(t *testing.T) {
	tlsOn, ca := natstest.TLS(t)
	srv := natstest.Start(t, tlsOn)
	e := envOn(t, srv, nats.RootCAs(ca))
	e.put("dev-1", "g")
	m := e.startMapper("m1", "--tlsca", ca)
	l := newLoad(t, e.js)
	l.publish([]string{"dev-1"}, 20)
	perDevice(t, e.readStream("OUTGOING", 20, 30*time.Second), map[string]int{"dev-1": 20})
	m.stop()

	_, errOut, code := runCLI(t, "run", "--server", srv.URL(), "--log-format", "json")
	t.Logf("run without --tlsca: %s", errOut)
	if code != 1 || !strings.Contains(errOut, "TLS") || !strings.Contains(errOut, "--tlsca") {
		t.Errorf("run without --tlsca against a TLS server: exit %d, stderr %q; want exit 1 naming TLS and --tlsca", code, errOut)
	}
}

func TestSecurityWrongPasswordSaysWhatToCheckAndHidesIt(t *testing.T) {
	srv := natstest.Start(t, users(map[string]grants{"mapper": replicaGrants}))
	for name, args := range map[string][]string{
		"password": {"--user", "mapper", "--password", "s3cret-wrong"},
		"token":    {"--token", "s3cret-wrong"},
		"url":      {"--server", strings.Replace(srv.URL(), "nats://", "nats://mapper:s3cret-wrong@", 1)},
	} {
		t.Run(name, func(t *testing.T) {
			_, errOut, code := runCLI(t, append([]string{"setup", "--server", srv.URL()}, args...)...)
			if code != 1 || !strings.Contains(errOut, "authorization violation") || !strings.Contains(errOut, "--creds") {
				t.Errorf("setup with a wrong %s: exit %d, stderr %q; want exit 1, authorization violation, check --creds…", name, code, errOut)
			}
			if strings.Contains(errOut, "s3cret-wrong") {
				t.Errorf("the error shows the secret: %s", errOut)
			}
		})
	}
}

func TestSecurityContextFileConnects(t *testing.T) {
	tlsOn, ca := natstest.TLS(t)
	srv := natstest.Start(t, tlsOn, users(map[string]grants{"setup": setupGrants}))
	home := t.TempDir()
	dir := filepath.Join(home, "nats", "context")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(map[string]string{"url": srv.URL(), "user": "setup", "password": "env://SETUP_PASSWORD", "ca": ca})
	if err := os.WriteFile(filepath.Join(dir, "secure.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("XDG_CONFIG_HOME", home)
	t.Setenv("SETUP_PASSWORD", "setup-pw")
	out, errOut, code := runCLI(t, "setup", "--context", "secure")
	if code != 0 || strings.Count(out, "created") != 5 {
		t.Fatalf("setup --context secure: exit %d, want 0 and five created:\n%s%s", code, out, errOut)
	}
	// NATS_CONTEXT is read as the nats CLI reads it.
	t.Setenv("NATS_CONTEXT", "secure")
	if out, errOut, code = runCLI(t, "setup"); code != 0 {
		t.Fatalf("setup with NATS_CONTEXT=secure: exit %d:\n%s%s", code, out, errOut)
	}
}
