package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
)

// TestDirectQuickStartEmbedded runs the README's direct-mode quick start: `kvmapper run
// --embedded --mode direct`, then the nats CLI commands it prints, with their outputs as the
// README shows them.
func TestDirectQuickStartEmbedded(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	url := "nats://127.0.0.1:" + strconv.Itoa(port)
	m := startProcess(t, "embedded", "run", "--embedded", "--mode", "direct", "--listen", "127.0.0.1:"+strconv.Itoa(port),
		"--data-dir", dir, "--replica-id", "embedded", "--log-format", "json")
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
	e := newDirectEnv(t, setup.ReceiveMapping)
	dev := "dev-42"
	e.put(dev, "group-a")
	r0 := e.startDirect("r0", setup.ReceiveMapping)
	e.waitServed("r0")
	d := e.startDevices([]string{dev}, false)
	d.waitAcked(100)
	e.put(dev, "group-b")
	waitTableRevision(t, e.srv.URL(), "r0", 2)
	d.waitAcked(100)
	r1 := e.startDirect("r1", setup.ReceiveMapping)
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
