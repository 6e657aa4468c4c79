package direct_test

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// TestOutputHeaders: direct mode renders the subject and output headers from the device's JSON
// value, as the lanes do, and replaces a header of the same name the device sent (in any case),
// so that a device cannot pass one off; the device's other headers pass through.
func TestOutputHeaders(t *testing.T) {
	f := newFixture(t, wire.ReceiveMapping)
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{region}.{group}.{device}.{event}", "unmapped.{device}.{event}", partitions)
	if err != nil {
		t.Fatal(err)
	}
	if lay, err = lay.WithHeaders([]string{"Tenant={tenant}", "Where={region}/{event}"}); err != nil {
		t.Fatal(err)
	}
	f.groups.schema = lay.Schema()
	f.groups.set("dev-7", `{"group":"g7","region":"eu","tenant":"acme"}`)
	p := f.pool("r1", nil, func(c *direct.Config) { c.Layout = lay })
	f.runAll(p, 5)
	m := nats.NewMsg("incoming.dev-7.temp")
	m.Header.Set("tenant", "spoofed")
	m.Header.Set("X-Trace", "abc")
	if ack, err := f.js.PublishMsg(context.Background(), m); err != nil || ack.Stream != "OUTGOING" {
		t.Fatalf("PublishMsg = %+v, %v; want OUTGOING's acknowledgement", ack, err)
	}
	got := f.stream("OUTGOING")
	if len(got) != 1 || got[0].Subject() != "outgoing.eu.g7.dev-7.temp" {
		t.Fatalf("OUTGOING holds %d messages (%v), want one on outgoing.eu.g7.dev-7.temp", len(got), got)
	}
	h := got[0].Headers()
	if h.Get("Tenant") != "acme" || h.Get("Where") != "eu/temp" || h.Get("X-Trace") != "abc" || h["tenant"] != nil {
		t.Errorf("headers %v, want Tenant acme, Where eu/temp, X-Trace abc and not the device's tenant", h)
	}
}
