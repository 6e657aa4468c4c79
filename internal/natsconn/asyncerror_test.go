package natsconn_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/natsconn"
	"github.com/kvmapper/kvmapper/internal/ratelog"
)

func TestPermissionViolationLog(t *testing.T) {
	var buf bytes.Buffer
	log := zerolog.New(&buf)
	limit := &ratelog.Limiter{Every: time.Hour}
	for i := range 100 {
		err := fmt.Errorf("%w: Permissions Violation for Publish to %q", nats.ErrPermissionViolation, fmt.Sprintf("outgoing.g.dev-%d.evt", i))
		natsconn.AsyncError(log, limit, nil, err)
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

func TestGrantFor(t *testing.T) {
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
		if got := natsconn.GrantFor(subject); got != want {
			t.Errorf("GrantFor(%q) = %q, want %q", subject, got, want)
		}
	}
}

func TestRedactURLs(t *testing.T) {
	got := natsconn.RedactURLs("nats://u:" + secret + "@a:4222, nats://" + secret + "@b:4222,nats://c:4222")
	if strings.Contains(got, secret) || !strings.Contains(got, "nats://c:4222") {
		t.Errorf("RedactURLs() = %q", got)
	}
}
