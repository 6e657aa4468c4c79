package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/wire"
)

// TestDirectQuickStartEmbedded runs the direct-mode quick start of docs/modes-and-layouts.md:
// `kvmapper run --embedded --mode direct`, then the nats CLI commands it prints, with their
// outputs as the page shows them.
func TestDirectQuickStartEmbedded(t *testing.T) {
	dir := t.TempDir()
	m := startProcess(t, "embedded", "run", "--embedded", "--mode", "direct", "--listen", "127.0.0.1:-1",
		"--data-dir", dir, "--replica-id", "embedded", "--log-format", "json")
	url := m.embeddedURL()
	next := "go tool nats -s " + url + " pub --jetstream incoming.dev-42.temp '{\"celsius\": 21.5}'"
	natstest.Eventually(t, 30*time.Second, func() error {
		if !strings.Contains(m.logs.String(), next) {
			return fmt.Errorf("next steps not printed yet")
		}
		return nil
	})
	cli := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("go", append([]string{"tool", "nats", "-s", url}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("go tool nats %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	cli("kv", "put", "device-groups", "dev-42", "group-a")
	waitTableRevision(t, url, "embedded", 1)

	if out := cli("pub", "--jetstream", "incoming.dev-42.temp", `{"celsius": 21.5}`); !strings.Contains(out, "Stored in Stream: OUTGOING Sequence: 1") {
		t.Errorf("nats pub --jetstream printed %q, want the PubAck of OUTGOING, sequence 1", out)
	}
	if out := cli("req", "incoming.dev-42.temp", `{"celsius": 22.0}`); !strings.Contains(out, `{"stream":"OUTGOING", "seq":2}`) &&
		!strings.Contains(out, `{"stream":"OUTGOING","seq":2}`) {
		t.Errorf("nats req printed %q, want OUTGOING's PubAck with sequence 2", out)
	}
	if out := cli("pub", "--jetstream", "incoming.dev-99.temp", "who?"); !strings.Contains(out, "Stored in Stream: UNMAPPED Sequence: 1") {
		t.Errorf("nats pub --jetstream for an unmapped device printed %q, want UNMAPPED's PubAck", out)
	}
	if out := cli("stream", "get", "UNMAPPED", "1"); !strings.Contains(out, "unmapped.dev-99.temp") || !strings.Contains(out, "KVMapper-Reason: no-mapping") {
		t.Errorf("nats stream get UNMAPPED 1 printed %q, want unmapped.dev-99.temp with KVMapper-Reason: no-mapping", out)
	}
	// No INCOMING in direct mode: the devices' messages are in OUTGOING, under their group.
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, err := js.Stream(context.Background(), "INCOMING"); err == nil {
		t.Error("stream INCOMING exists in direct mode")
	}
	msg, err := js.Stream(context.Background(), "OUTGOING")
	if err != nil {
		t.Fatal(err)
	}
	got, err := msg.GetMsg(context.Background(), 2)
	if err != nil || got.Subject != "outgoing.group-a.dev-42.temp" || string(got.Data) != `{"celsius": 22.0}` {
		t.Errorf("OUTGOING message 2 = %v, %v; want the second one on outgoing.group-a.dev-42.temp", got, err)
	}
	m.stop()
}

// waitTableRevision waits until replica id's groups table has applied revision rev, as its status
// endpoint reports.
func waitTableRevision(t *testing.T, url, id string, rev uint64) {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	natstest.Eventually(t, 10*time.Second, func() error {
		resp, err := nc.Request(status.StatusSubject("kvmapper", id), nil, time.Second)
		if err != nil {
			return err
		}
		var r status.Report
		if err := json.Unmarshal(resp.Data, &r); err != nil {
			return err
		}
		if r.Table.Revision < rev {
			return fmt.Errorf("table at revision %d, want %d", r.Table.Revision, rev)
		}
		return nil
	})
}

// TestDirectMappingChangeTakesEffectAtOnePoint moves a device between groups while it publishes,
// with a rebalance in the middle, the device's partition handed from one replica to another: its
// messages go to each group in turn, each switch at one point, never back (I4).
func TestDirectMappingChangeTakesEffectAtOnePoint(t *testing.T) {
	e := newDirectEnv(t, wire.ReceiveMapping)
	dev := "dev-42"
	e.put(dev, "group-a")
	r0 := e.startDirect("r0", wire.ReceiveMapping)
	e.waitServed("r0")
	d := e.startDevices([]string{dev}, false)
	d.waitAcked(100)
	e.put(dev, "group-b")
	waitTableRevision(t, e.srv.URL(), "r0", 2)
	d.waitAcked(100)
	r1 := e.startDirect("r1", wire.ReceiveMapping)
	e.waitServed("r0", "r1")
	e.put(dev, "group-c")
	for _, id := range []string{"r0", "r1"} {
		waitTableRevision(t, e.srv.URL(), id, 3)
	}
	d.waitAcked(100)
	r0.stop() // whichever owned the device's partition, it is r1's now
	e.waitServed("r1")
	e.put(dev, "group-d")
	waitTableRevision(t, e.srv.URL(), "r1", 4)
	d.waitAcked(100)
	sent, _ := d.halt()
	msgs := e.readStream("OUTGOING", sent[dev], 30*time.Second)
	perDevice(t, msgs, sent)
	var groups []string // the groups in the order the messages went to them
	for _, m := range msgs {
		g := strings.Split(m.Subject(), ".")[1]
		if len(groups) == 0 || groups[len(groups)-1] != g {
			groups = append(groups, g)
		}
	}
	if want := []string{"group-a", "group-b", "group-c", "group-d"}; !slices.Equal(groups, want) {
		t.Fatalf("the device's messages went to %v in turn, want %v: each switch at one point", groups, want)
	}
	r1.stop()
}

// TestDirectStatusAndVerify runs `kvmapper status` and `kvmapper verify` against a replica in
// direct mode, which has no INCOMING: status must show the owners, the control bucket, OUTGOING
// and UNMAPPED and say why INCOMING is not read; verify must refuse and say what to check instead.
func TestDirectStatusAndVerify(t *testing.T) {
	e := newDirectEnv(t, wire.ReceiveMapping)
	m := e.startDirect("d0", wire.ReceiveMapping)
	e.waitServed("d0")
	e.put("dev-1", "group-a")
	waitTableRevision(t, e.srv.URL(), "d0", 1)
	ctx := context.Background()
	for _, c := range []struct{ device, stream string }{{"dev-1", "OUTGOING"}, {"dev-2", "UNMAPPED"}} {
		ack, err := e.js.Publish(ctx, "incoming."+c.device+".temp", []byte("x"))
		if err != nil || ack.Stream != c.stream {
			t.Fatalf("Publish(incoming.%s.temp) = %+v, %v; want %s's PubAck", c.device, ack, err, c.stream)
		}
	}

	out, errOut, code := e.cli("status", "--rate-window", "0")
	if code != 0 {
		t.Fatalf("kvmapper status in direct mode: exit %d, want 0:\n%s%s", code, out, errOut)
	}
	for _, want := range []string{
		"direct mode: no INCOMING to read",
		"control bucket kvmapper: 16 of 16 partitions leased, 1 member",
		"stream OUTGOING: 1 message, sequences 1 to 1",
		"stream UNMAPPED: 1 message, sequences 1 to 1",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("kvmapper status output lacks %q:\n%s", want, out)
		}
	}
	for p := range partitions {
		if !regexp.MustCompile(fmt.Sprintf(`(?m)^%d\s+d0\s+\d+\s+-\s+\d+\s+-`, p)).MatchString(out) {
			t.Errorf("kvmapper status shows no row for partition %d owned by d0 with an epoch, no checkpoint and a lag:\n%s", p, out)
		}
	}
	js, _, code := e.cli("status", "--json", "--rate-window", "0")
	var snap status.Snapshot
	if err := json.Unmarshal([]byte(js), &snap); code != 0 || err != nil || snap.Mode != "direct" || len(snap.Outputs) != 2 {
		t.Errorf("kvmapper status --json: exit %d, %v: mode %q, outputs %+v; want direct with OUTGOING and UNMAPPED", code, err, snap.Mode, snap.Outputs)
	}

	out, errOut, code = e.cli("verify")
	if code != 1 || !strings.Contains(errOut, "direct mode has no INCOMING to audit against") || !strings.Contains(errOut, "PubAcks") {
		t.Errorf("kvmapper verify in direct mode: exit %d, want 1 with the refusal saying what to check instead:\n%s%s", code, out, errOut)
	}
	t.Logf("kvmapper verify: %s", strings.TrimSpace(errOut))
	m.stop()
}
