package integration

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/wire"
)

// metaFlags route on three fields of the device's value and carry two of them, and a fourth,
// in output headers.
var metaFlags = []string{"--out", "outgoing.{region}.{group}.{device}.{event}",
	"--header", "Tenant={tenant}", "--header", "Site={region}/{site}"}

// metaValue is version k of a device's value: every field the templates use says k, and a nested
// field they do not use is ignored.
func metaValue(k int) string {
	return fmt.Sprintf(`{"group":"g%d","region":"r%d","tenant":"t%d","site":"s%d","notes":{"any":["thing",%d]}}`, k, k, k, k, k)
}

// kvPut writes a device's value with the nats CLI, as an operator does, and returns its revision.
func (e *env) kvPut(device, value string) uint64 {
	e.t.Helper()
	natsCLI(e.t, e, "kv", "put", "device-groups", device, value)
	ent, err := e.groups.Get(context.Background(), device)
	if err != nil {
		e.t.Fatalf("Get(%s) after kv put: %v", device, err)
	}
	if string(ent.Value()) != value {
		e.t.Fatalf("Get(%s) = %q after kv put, want %q", device, ent.Value(), value)
	}
	return ent.Revision()
}

// putRev writes a device's value with the client and returns its revision.
func (e *env) putRev(device, value string) uint64 {
	e.t.Helper()
	rev, err := e.groups.PutString(context.Background(), device, value)
	if err != nil {
		e.t.Fatalf("Put(%s): %v", device, err)
	}
	return rev
}

// checkVersions checks every message of OUTGOING for the devices of revs (revs[d][k] is the
// revision of version k of d's value): each device's messages are numbered 0, 1, 2… in order;
// each one's subject and both headers are those of one version k, all fields alike, with the
// revision of that version in KVMapper-Prov; and k never goes back, so that each change of
// value took effect at one point in the device's stream. It returns, per device, the messages
// mapped with each version.
func checkVersions(t *testing.T, msgs []jetstream.Msg, revs map[string][]uint64) map[string][]int {
	t.Helper()
	next := map[string]int{}
	cur := map[string]int{}
	per := map[string][]int{}
	for i, m := range msgs {
		dev, num, _ := strings.Cut(string(m.Data()), ":")
		n, err := strconv.Atoi(num)
		if err != nil || revs[dev] == nil {
			t.Fatalf("message %d: payload %q not from this test", i, m.Data())
		}
		if n != next[dev] {
			t.Fatalf("message %d (%s): %s's message %d after %d of its messages: reordered, duplicated or lost", i, m.Subject(), dev, n, next[dev])
		}
		next[dev]++
		tok := strings.Split(m.Subject(), ".")
		if len(tok) != 5 || tok[0] != "outgoing" || tok[3] != dev || tok[4] != "evt" || !strings.HasPrefix(tok[1], "r") {
			t.Fatalf("message %d: subject %s, want outgoing.r<k>.g<k>.%s.evt", i, m.Subject(), dev)
		}
		k, err := strconv.Atoi(tok[1][1:])
		if err != nil || k >= len(revs[dev]) {
			t.Fatalf("message %d: subject %s names no version of %s's value", i, m.Subject(), dev)
		}
		h := m.Headers()
		want := fmt.Sprintf("outgoing.r%d.g%d.%s.evt Tenant=t%d Site=r%d/s%d rev=%d", k, k, dev, k, k, k, revs[dev][k])
		got := fmt.Sprintf("%s Tenant=%s Site=%s rev=%s", m.Subject(), h.Get("Tenant"), h.Get("Site"), revisionOf(h))
		if got != want {
			t.Fatalf("message %d of %s: %s, want %s: fields of two values mixed, or the wrong revision", n, dev, got, want)
		}
		for name := range h {
			if strings.EqualFold(name, "Tenant") && name != "Tenant" {
				t.Fatalf("message %d of %s carries the device's own %s header %q besides the output header", n, dev, name, h[name])
			}
		}
		if k < cur[dev] {
			t.Fatalf("message %d of %s mapped with version %d after one mapped with version %d: not one switch point", n, dev, k, cur[dev])
		}
		cur[dev] = k
		for len(per[dev]) <= k {
			per[dev] = append(per[dev], 0)
		}
		per[dev][k]++
	}
	return per
}

// publisher publishes numbered messages ("<device>:<n>") for devices in turns, stream mode, until
// stopped, each batch acknowledged by INCOMING before the next.
type publisher struct {
	stop chan struct{}
	done chan error
	mu   sync.Mutex
	sent map[string]int
}

func startPublisher(js jetstream.JetStream, devs []string) *publisher {
	p := &publisher{stop: make(chan struct{}), done: make(chan error, 1), sent: map[string]int{}}
	go func() {
		p.done <- func() error {
			for {
				select {
				case <-p.stop:
					return nil
				default:
				}
				var futs []jetstream.PubAckFuture
				p.mu.Lock()
				for range 10 {
					for _, d := range devs {
						// A device's own header of an output header's name never reaches OUTGOING.
						m := &nats.Msg{Subject: "incoming." + d + ".evt", Data: []byte(d + ":" + strconv.Itoa(p.sent[d])),
							Header: nats.Header{"tenant": []string{"spoofed"}, "X-Device": []string{"kept"}}}
						f, err := js.PublishMsgAsync(m)
						if err != nil {
							p.mu.Unlock()
							return err
						}
						p.sent[d]++
						futs = append(futs, f)
					}
				}
				p.mu.Unlock()
				for _, f := range futs {
					select {
					case <-f.Ok():
					case err := <-f.Err():
						return fmt.Errorf("publish to INCOMING: %w", err)
					case <-time.After(30 * time.Second):
						return errors.New("publish to INCOMING: no acknowledgement within 30s")
					}
				}
			}
		}()
	}()
	return p
}

// halt stops the publisher and returns how many messages it sent in all.
func (p *publisher) halt(t *testing.T) int {
	t.Helper()
	close(p.stop)
	if err := <-p.done; err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.sent {
		n += c
	}
	return n
}

// waitMore waits until stream holds at least n messages more than it did when called.
func (e *env) waitMore(stream string, n int) {
	e.t.Helper()
	want := e.count(stream) + n
	natstest.Eventually(e.t, 30*time.Second, func() error {
		if got := e.count(stream); got < want {
			return fmt.Errorf("%s holds %d messages, want %d", stream, got, want)
		}
		return nil
	})
}

// TestMetadataRoutingUnderLoad: in both stream layouts, a replica routes on three fields of each
// device's JSON value (written with `nats kv put`) and carries fields in two output headers,
// while the values change under load, every field at once. Every message is checked: its
// subject and headers come from one version of its device's value, with that version's
// revision, in the device's order, and each change takes effect at one point (I4). Then verify
// checks every OUTGOING message against the value it was mapped with, and replay --as-of maps a
// range with the whole value each device had at that revision.
func TestMetadataRoutingUnderLoad(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		devs := deviceNames("dev-", 6)
		revs := map[string][]uint64{}
		for _, d := range devs {
			revs[d] = []uint64{e.putRev(d, metaValue(0))}
		}
		m := e.startMapper("a", metaFlags...)
		pub := startPublisher(e.js, devs)
		const versions = 3
		var asOf uint64 // the revision after every device's version 1: replay maps with it
		for k := 1; k < versions; k++ {
			e.waitMore("OUTGOING", 200) // messages mapped with the version before
			for i, d := range devs {
				if i == 0 {
					revs[d] = append(revs[d], e.kvPut(d, metaValue(k))) // as an operator does
				} else {
					revs[d] = append(revs[d], e.putRev(d, metaValue(k)))
				}
			}
			if k == 1 {
				asOf = revs[devs[len(devs)-1]][1]
			}
		}
		e.waitMore("OUTGOING", 200) // and after the last
		total := pub.halt(t)
		msgs := e.readStream("OUTGOING", total, 60*time.Second)
		if len(msgs) != total {
			t.Fatalf("OUTGOING holds %d messages, want the %d published", len(msgs), total)
		}
		per := checkVersions(t, msgs, revs)
		for _, d := range devs {
			if c := per[d]; len(c) != versions || c[0] == 0 || c[versions-1] == 0 {
				t.Errorf("%s: messages per version %v, want some under the first and the last of %d: the switches happened under load", d, c, versions)
			}
		}
		m.stop()

		// verify: order, gaps, duplicates, and every message against its value.
		out, errOut, code := e.cli("verify", metaFlags...)
		if code != 0 || !strings.Contains(out, fmt.Sprintf("%d of OUTGOING as the value each was mapped with renders it", total)) {
			t.Errorf("kvmapper verify: exit %d, want 0 with every message checked against its value:\n%s%s", code, out, errOut)
		}
		// verify without the headers the deployment sets still passes (subjects only) …
		if out, errOut, code := e.cli("verify", metaFlags[:2]...); code != 0 {
			t.Errorf("kvmapper verify without --header: exit %d, want 0:\n%s%s", code, out, errOut)
		}
		// … and one told of a header the deployment does not set fails, naming it.
		wrong := append(append([]string(nil), metaFlags...), "--header", "Tier={tenant}")
		if out, _, code := e.cli("verify", wrong...); code != 1 || !strings.Contains(out, "header Tier") {
			t.Errorf("kvmapper verify with a header the messages lack: exit %d, want 1 naming header Tier:\n%s", code, out)
		}

		// replay the whole range as of the revision after every device's version 1.
		args := append([]string{"--from-time", "1h", "--as-of", strconv.FormatUint(asOf, 10), "--into", "REPLAY", "--create",
			"--header", "Tenant={tenant}", "--header", "Site={region}/{site}"}, "--out", "replay.{region}.{group}.{device}.{event}")
		if out, errOut, code := e.cli("replay", args...); code != 0 {
			t.Fatalf("kvmapper replay: exit %d\n%s%s", code, out, errOut)
		}
		replayed := e.readStream("REPLAY", total, 60*time.Second)
		next := map[string]int{}
		for i, rm := range replayed {
			dev, _, _ := strings.Cut(string(rm.Data()), ":")
			h := rm.Headers()
			got := fmt.Sprintf("%s Tenant=%s Site=%s rev=%s", rm.Subject(), h.Get("Tenant"), h.Get("Site"), revisionOf(h))
			want := fmt.Sprintf("replay.r1.g1.%s.evt Tenant=t1 Site=r1/s1 rev=%d", dev, revs[dev][1])
			if got != want {
				t.Fatalf("replayed message %d (%s): %s, want %s", i, rm.Data(), got, want)
			}
			if want := dev + ":" + strconv.Itoa(next[dev]); string(rm.Data()) != want {
				t.Fatalf("replayed message %d is %q, want %q: out of order", i, rm.Data(), want)
			}
			next[dev]++
		}
	})
}

// TestMetadataBadValues: a value the templates cannot use dead-letters its device's messages
// with a reason naming the field (KVMapper-Field) and why (KVMapper-Error), never stops the
// lane (the other devices are mapped in order meanwhile), and status counts the devices by
// reason; fixed, the device is mapped again. Under --on-unmapped park the same devices are
// parked instead, and released in order, with the right subject and headers, once fixed.
func TestMetadataBadValues(t *testing.T) {
	bad := []struct{ device, value, reason, field string }{
		{"dev-plain", "g7", wire.ReasonMissingField, "region"},
		{"dev-dot", `{"group":"g7","region":"eu.west","tenant":"t","site":"s"}`, wire.ReasonInvalidField, "region"},
		{"dev-inject", `{"group":"g7","region":"eu","tenant":"a\r\nNats-Msg-Id: x","site":"s"}`, wire.ReasonInvalidField, "tenant"},
		{"dev-nested", `{"group":{"id":"g7"},"region":"eu","tenant":"t","site":"s"}`, wire.ReasonInvalidField, "group"},
		{"dev-broken", `{"group":"g7","region":"eu"`, wire.ReasonInvalidValue, ""},
		{"dev-nosite", `{"group":"g7","region":"eu","tenant":"t"}`, wire.ReasonMissingField, "site"},
	}
	setBad := func(e *env) uint64 {
		for _, b := range bad {
			e.putRev(b.device, b.value)
		}
		return e.putRev("dev-ok", metaValue(0))
	}
	publish := func(e *env, devs []string, from, n int) {
		t.Helper()
		for i := from; i < from+n; i++ {
			for _, d := range devs {
				if _, err := e.js.Publish(context.Background(), "incoming."+d+".evt", []byte(d+":"+strconv.Itoa(i))); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	var devs []string
	for _, b := range bad {
		devs = append(devs, b.device)
	}

	t.Run("dead-letter", func(t *testing.T) {
		e := newEnv(t)
		okRev := setBad(e)
		e.startMapper("a", metaFlags...)
		publish(e, append([]string{"dev-ok"}, devs...), 0, 3)
		dead := e.readStream("UNMAPPED", 3*len(bad), 30*time.Second)
		got := map[string]int{}
		for _, m := range dead {
			dev, _, _ := strings.Cut(string(m.Data()), ":")
			h := m.Headers()
			var want *struct{ device, value, reason, field string }
			for i := range bad {
				if bad[i].device == dev {
					want = &bad[i]
				}
			}
			if want == nil {
				t.Fatalf("UNMAPPED holds %q of %s, which has a good value", m.Data(), dev)
			}
			if h.Get(wire.HeaderReason) != want.reason || h.Get(wire.HeaderField) != want.field || h.Get(wire.HeaderError) == "" ||
				m.Subject() != "unmapped."+dev+".evt" || h.Get("Tenant") != "" {
				t.Errorf("dead letter of %s on %s: reason %q, field %q, error %q, Tenant %q; want %s, %q, a why, no output header",
					dev, m.Subject(), h.Get(wire.HeaderReason), h.Get(wire.HeaderField), h.Get(wire.HeaderError), h.Get("Tenant"), want.reason, want.field)
			}
			if want := dev + ":" + strconv.Itoa(got[dev]); string(m.Data()) != want {
				t.Errorf("dead letter %q, want %q: out of order", m.Data(), want)
			}
			got[dev]++
		}
		ok := e.readStream("OUTGOING", 3, 30*time.Second)
		checkVersions(t, ok, map[string][]uint64{"dev-ok": {okRev}}) // mapped meanwhile: the lanes went on

		st, err := statusJSON(t, e)
		if err != nil {
			t.Fatal(err)
		}
		wantInvalid := map[string]int{wire.ReasonMissingField: 2, wire.ReasonInvalidField: 3, wire.ReasonInvalidValue: 1}
		var reported map[string]int
		for _, r := range st.Replicas {
			if r.Report != nil {
				reported = r.Report.Table.Invalid
			}
		}
		if fmt.Sprint(reported) != fmt.Sprint(wantInvalid) {
			t.Errorf("kvmapper status: the replica counts %v devices with an unusable value, want %v", reported, wantInvalid)
		}
		out, _, _ := e.cli("status")
		if !strings.Contains(out, "6 devices whose value the templates cannot use (invalid-field 3, invalid-value 1, missing-field 2)") {
			t.Errorf("kvmapper status does not count the devices with an unusable value:\n%s", out)
		}

		// Fixed: mapped again, from the next message on.
		rev := e.putRev("dev-dot", metaValue(1))
		natstest.Eventually(t, 30*time.Second, func() error {
			if st, err := statusJSON(t, e); err != nil || len(st.Replicas) == 0 || st.Replicas[0].Report == nil ||
				st.Replicas[0].Report.Table.Invalid[wire.ReasonInvalidField] != 2 {
				return fmt.Errorf("the replica has not applied the fix yet (%v)", err)
			}
			return nil
		})
		publish(e, []string{"dev-dot"}, 3, 2)
		msgs := e.readStream("OUTGOING", 5, 30*time.Second)
		for i, m := range msgs[3:] {
			h := m.Headers()
			got := fmt.Sprintf("%s %s Tenant=%s Site=%s rev=%s", m.Data(), m.Subject(), h.Get("Tenant"), h.Get("Site"), revisionOf(h))
			if want := fmt.Sprintf("dev-dot:%d outgoing.r1.g1.dev-dot.evt Tenant=t1 Site=r1/s1 rev=%d", 3+i, rev); got != want {
				t.Errorf("after the fix: %s, want %s", got, want)
			}
		}
	})

	t.Run("park", func(t *testing.T) {
		e := newEnv(t)
		setBad(e)
		e.startMapper("a", append([]string{"--on-unmapped", "park"}, metaFlags...)...)
		publish(e, devs, 0, 3)
		e.readStream("PARKED", 3*len(bad), 30*time.Second)
		if n := e.count("UNMAPPED"); n != 0 {
			t.Fatalf("UNMAPPED holds %d messages under --on-unmapped park, want 0: bad values park their device", n)
		}
		revs := map[string][]uint64{}
		for _, d := range devs {
			revs[d] = []uint64{0, e.putRev(d, metaValue(1))}
		}
		publish(e, devs, 3, 2) // after the fix: behind the parked ones, in order
		msgs := e.readStream("OUTGOING", 5*len(bad), 30*time.Second)
		per := checkVersions(t, msgs, revs)
		for _, d := range devs {
			if per[d][1] != 5 {
				t.Errorf("%s: %v messages per version, want all 5 mapped with the fixed value", d, per[d])
			}
		}
	})
}

// TestMetadataDirectMode: direct mode renders the same templates. Devices publish for their
// PubAck from OUTGOING while their values change, every field at once; every message is checked
// as in stream mode. A device whose value the templates cannot use gets its PubAck from UNMAPPED,
// with the reason and the field.
func TestMetadataDirectMode(t *testing.T) {
	e := newDirectEnv(t, wire.ReceiveMapping)
	devs := deviceNames("dev-", 6)
	revs := map[string][]uint64{}
	for _, d := range devs {
		revs[d] = []uint64{e.putRev(d, metaValue(0))}
	}
	e.startDirect("a", wire.ReceiveMapping, append([]string{"--direct-provenance"}, metaFlags...)...) // KVMapper-Prov, with the revision
	e.waitServed("a")
	d := e.startDevices(devs, false)
	const versions = 3
	for k := 1; k < versions; k++ {
		d.waitAcked(100)
		for i, dev := range devs {
			if i == 0 {
				revs[dev] = append(revs[dev], e.kvPut(dev, metaValue(k)))
			} else {
				revs[dev] = append(revs[dev], e.putRev(dev, metaValue(k)))
			}
		}
	}
	d.waitAcked(100)
	sent, _ := d.halt()
	total := 0
	for _, n := range sent {
		total += n
	}
	msgs := e.readStream("OUTGOING", total, 30*time.Second)
	if len(msgs) != total {
		t.Fatalf("OUTGOING holds %d messages, want the %d acknowledged", len(msgs), total)
	}
	per := checkVersions(t, msgs, revs)
	for _, dev := range devs {
		if c := per[dev]; len(c) != versions || c[0] == 0 || c[versions-1] == 0 {
			t.Errorf("%s: messages per version %v, want some under the first and the last of %d", dev, c, versions)
		}
	}

	e.putRev("dev-bad", `{"group":"g7","region":"eu","tenant":"t"}`)
	natstest.Eventually(t, 30*time.Second, func() error { // the replica has the value
		st, err := statusJSON(t, e)
		if err != nil || len(st.Replicas) == 0 || st.Replicas[0].Report == nil || st.Replicas[0].Report.Table.Invalid[wire.ReasonMissingField] != 1 {
			return fmt.Errorf("the replica does not count dev-bad's value yet (%v)", err)
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ack, err := e.js.Publish(ctx, "incoming.dev-bad.evt", []byte("dev-bad:0"), jetstream.WithMsgID("dev-bad:0"))
	if err != nil || ack.Stream != "UNMAPPED" {
		t.Fatalf("dev-bad's message: %+v, %v; want a PubAck from UNMAPPED", ack, err)
	}
	m := e.readStream("UNMAPPED", 1, 30*time.Second)[0]
	if h := m.Headers(); h.Get(wire.HeaderReason) != wire.ReasonMissingField || h.Get(wire.HeaderField) != "site" || h.Get(wire.HeaderError) == "" {
		t.Errorf("dead letter of dev-bad: reason %q, field %q, error %q; want %s, site, a why",
			h.Get(wire.HeaderReason), h.Get(wire.HeaderField), h.Get(wire.HeaderError), wire.ReasonMissingField)
	}
}

// revisionOf returns the revision a message's provenance names, "" when none.
func revisionOf(h nats.Header) string {
	if pv, _ := wire.ReadProvenance(h.Get); pv.Revision != 0 {
		return strconv.FormatUint(pv.Revision, 10)
	}
	return ""
}
