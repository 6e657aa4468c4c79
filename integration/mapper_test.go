package integration

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func TestSetupIsIdempotentAndRefusesAMismatch(t *testing.T) {
	srv := natstest.Start(t)
	out, errOut, code := runCLI(t, "setup", "--server", srv.URL())
	if code != 0 {
		t.Fatalf("first setup: exit %d: %s", code, errOut)
	}
	for _, want := range []string{"created stream INCOMING", "created stream OUTGOING", "created stream UNMAPPED",
		"created bucket device-groups", "created bucket kvmapper"} {
		if !strings.Contains(out, want) {
			t.Errorf("first setup output lacks %q:\n%s", want, out)
		}
	}
	out, errOut, code = runCLI(t, "setup", "--server", srv.URL())
	if code != 0 {
		t.Fatalf("second setup: exit %d: %s", code, errOut)
	}
	if strings.Contains(out, "created") || strings.Count(out, " ok") != 5 {
		t.Errorf("second setup should find all five ok and create nothing:\n%s", out)
	}
	_, errOut, code = runCLI(t, "setup", "--server", srv.URL(), "--partitions", "8")
	if code != 1 {
		t.Fatalf("setup --partitions 8 on a 16-partition INCOMING: exit %d, want 1", code)
	}
	for _, want := range []string{"16 partitions", "--partitions 16"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("mismatch error %q does not say %q", errOut, want)
		}
	}
	// run refuses the same way, before it maps anything.
	_, errOut, code = runCLI(t, "run", "--server", srv.URL(), "--partitions", "8", "--log-format", "json")
	if code != 1 || !strings.Contains(errOut, "--partitions 16") {
		t.Errorf("run --partitions 8: exit %d, stderr %q; want exit 1 naming the fix", code, errOut)
	}
}

func TestMoveADeviceWithTheNatsCLIWhileMessagesFlow(t *testing.T) {
	e := newEnv(t)
	e.put("dev-42", "group-a")
	e.put("dev-7", "group-c")
	e.startMapper("m1")

	stop := make(chan struct{})
	var wg sync.WaitGroup
	published := map[string]int{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < 200_000; i++ {
			select {
			case <-stop:
				return
			default:
			}
			for _, d := range []string{"dev-42", "dev-7"} {
				if _, err := e.js.Publish(context.Background(), "incoming."+d+".evt", []byte(d+":"+strconv.Itoa(i))); err != nil {
					t.Errorf("publish: %v", err)
					return
				}
				published[d]++
			}
		}
	}()
	waitCount(t, e, "outgoing.group-a.dev-42.>", 200)

	cli := exec.Command("go", "tool", "nats", "--server", e.srv.URL(), "kv", "put", "device-groups", "dev-42", "group-b")
	if out, err := cli.CombinedOutput(); err != nil {
		close(stop)
		wg.Wait()
		t.Fatalf("go tool nats kv put: %v\n%s", err, out)
	}
	waitCount(t, e, "outgoing.group-b.dev-42.>", 200)
	close(stop)
	wg.Wait()

	msgs := e.readStream("OUTGOING", published["dev-42"]+published["dev-7"], 60*time.Second)
	subjects := perDevice(t, msgs, published)
	// dev-42: one prefix under group-a, one suffix under group-b, never interleaved (I4).
	switched := -1
	for i, s := range subjects["dev-42"] {
		want := "outgoing.group-a.dev-42.evt"
		if switched >= 0 {
			want = "outgoing.group-b.dev-42.evt"
		} else if s == "outgoing.group-b.dev-42.evt" {
			switched, want = i, s
		}
		if s != want {
			t.Fatalf("dev-42 message %d went to %s after the switch at %d", i, s, switched)
		}
	}
	if switched < 200 {
		t.Fatalf("dev-42 switched at message %d, want after the first 200 under group-a", switched)
	}
	for i, s := range subjects["dev-7"] {
		if s != "outgoing.group-c.dev-7.evt" {
			t.Fatalf("dev-7 message %d went to %s", i, s)
		}
	}
	t.Logf("dev-42: %d messages under group-a, then %d under group-b", switched, len(subjects["dev-42"])-switched)
}

// waitCount waits until OUTGOING holds at least n messages on subjects matching filter.
func waitCount(t *testing.T, e *env, filter string, n int) {
	t.Helper()
	natstest.Eventually(t, 60*time.Second, func() error {
		s, err := e.js.Stream(context.Background(), "OUTGOING")
		if err != nil {
			return err
		}
		info, err := s.Info(context.Background(), jetstream.WithSubjectFilter(filter))
		if err != nil {
			return err
		}
		var got uint64
		for _, c := range info.State.Subjects {
			got += c
		}
		if got < uint64(n) {
			return fmt.Errorf("%s: %d messages, want %d", filter, got, n)
		}
		return nil
	})
}

func TestDeletedKeyAndInvalidValuesGoToUnmapped(t *testing.T) {
	e := newEnv(t)
	bad := map[string]string{"dot": "a.b", "star": "*", "gt": ">", "empty": "", "long": strings.Repeat("g", 300)}
	for d, v := range bad {
		e.put(d, v)
	}
	e.put("gone", "group-a")
	e.put("fine", "group-a")
	m := e.startMapper("m1")
	if err := e.groups.Delete(context.Background(), "gone"); err != nil {
		t.Fatal(err)
	}
	ld := newLoad(t, e.js)
	devs := []string{"dot", "star", "gt", "empty", "long", "fine"}
	ld.publish(devs, 5)
	unmapped := e.readStream("UNMAPPED", 25, 30*time.Second)
	want := map[string]int{}
	for d := range bad {
		want[d] = 5
	}
	perDevice(t, unmapped[:25], want)
	for _, msg := range unmapped {
		if r := msg.Headers().Get("KVMapper-Reason"); r != "invalid-group" {
			t.Errorf("%s: reason %q, want invalid-group", msg.Subject(), r)
		}
	}
	perDevice(t, e.readStream("OUTGOING", 5, 30*time.Second), map[string]int{"fine": 5})

	// The deleted key: the mapper applies the delete asynchronously, so publish until a message
	// of "gone" is dead-lettered with no-mapping.
	natstest.Eventually(t, 10*time.Second, func() error {
		if _, err := e.js.Publish(context.Background(), "incoming.gone.evt", []byte("probe")); err != nil {
			return err
		}
		for _, msg := range e.readStream("UNMAPPED", 25, time.Second) {
			if msg.Subject() == "unmapped.gone.evt" && msg.Headers().Get("KVMapper-Reason") == "no-mapping" {
				return nil
			}
		}
		return fmt.Errorf("no message of the deleted device in UNMAPPED yet")
	})
	// The service kept running: still mapping, and it logged the bad values.
	ld.publish([]string{"fine"}, 1)
	perDevice(t, e.readStream("OUTGOING", 6, 30*time.Second)[:6], map[string]int{"fine": 6})
	m.waitLog("invalid", 5*time.Second)
}

func TestRestartingTheMapperResumesFromTheCheckpoint(t *testing.T) {
	eachLayout(t, func(t *testing.T, e *env) {
		devs := e.mappedDevices(100)
		ld := newLoad(t, e.js)
		ld.publish(devs, 100)
		first := ld.total()
		w := e.tapWire()
		// Mid-stream by construction: m1 reaches the server through a proxy that forwards its
		// first 2000 publishes to OUTGOING and holds the next, until m1 has begun its graceful
		// stop; then what it held goes through, and m1 drains it and writes its final
		// checkpoints. With 64 publishes in flight at most, m1 then stops inside every
		// partition it was mapping (about 625 messages each).
		px := newProxy(t, "127.0.0.1:"+strconv.Itoa(e.srv.Port()))
		px.HoldAfter("outgoing.", 2000)
		m1 := e.startMapper("m1", "--server", px.URL(), "--max-in-flight", "64")
		if n, _ := px.WaitHeld(1, 60*time.Second); n == 0 {
			t.Fatal("m1 sent nothing beyond its first 2000 publishes within 60s")
		}
		m1.term()
		natstest.Eventually(t, 30*time.Second, func() error {
			if _, err := e.ctl.Get(context.Background(), wire.MemberKey("m1")); err == nil {
				return errors.New("m1 has not begun to leave (its member key is there)")
			}
			return nil
		})
		px.Release()
		m1.waitExit() // drains what is in flight and writes the final checkpoints
		mapped1, dup1 := m1.stoppedStats()
		w.marker()          // every publish of m1 is recorded
		m1Sent := w.count() // m2 sends the publishes recorded after these

		// The stop really was mid-stream: some but not all mapped, each device a prefix of its
		// messages, and every partition's checkpoint is the last INCOMING sequence it sent, nonzero
		// and below the partition's last sequence for at least one.
		n1 := e.count("OUTGOING")
		if n1 == 0 || n1 >= first || int(mapped1) != n1 {
			t.Fatalf("after SIGTERM: OUTGOING holds %d, m1 mapped %v, want the same number, above 0 and below the %d sent: the stop was not mid-stream", n1, mapped1, first)
		}
		out1 := e.readStream("OUTGOING", n1, 10*time.Second)
		perDevice(t, out1, nil)
		sentUpTo := map[int]uint64{} // partition → last INCOMING sequence m1 published
		for _, m := range out1 {
			p, _, seq := provenance(t, m.Subject(), m.Headers())
			sentUpTo[p] = max(sentUpTo[p], seq)
		}
		in := e.partitionSeqs(first)
		cps := map[int]uint64{}
		midway, started := 0, 0
		for p := 0; p < partitions; p++ {
			cps[p] = e.checkpoint(p)
			if cps[p] != sentUpTo[p] {
				t.Errorf("checkpoint.%d = %d after SIGTERM, want %d, the last INCOMING sequence m1 published for it", p, cps[p], sentUpTo[p])
			}
			if len(in[p]) > 0 && cps[p] > 0 && cps[p] < in[p][len(in[p])-1] {
				midway++
			}
			if cps[p] > 0 {
				started++
			}
		}
		switch {
		case midway > 0:
		case e.names.StreamLayout == subjects.PartitionStreams && started > 0:
			// Each lane reads its own stream at full speed: at the SIGTERM a partition is
			// mostly done or not started. The next publish puts messages behind every
			// checkpoint, so m2 still has to resume after nonzero ones.
		default:
			t.Fatalf("checkpoints %v after SIGTERM: none above 0 and below its partition's last INCOMING sequence: the stop was not mid-stream", cps)
		}

		ld.publish(devs, 50)
		in = e.partitionSeqs(ld.total())
		m2 := e.startMapper("m2")
		want := each(devs, 150)
		perDevice(t, e.readStream("OUTGOING", 15_000, 60*time.Second), want)
		m2.stop()
		mapped2, dup2 := m2.stoppedStats()
		// A mapper resends what it had in flight when the server answered nothing for the stall
		// timeout (a loaded machine), and OUTGOING acknowledges those it had stored as
		// duplicates: that is each mapper's own doing, and counted as its retries. What the
		// checkpoint must rule out is m2 sending again what m1 had sent.
		retries1, retries2 := m1.stoppedRetries(), m2.stoppedRetries()
		if dup1 > retries1 || dup2 > retries2 {
			t.Errorf("publishes acknowledged as duplicates: %v then %v, beyond the mappers' own %v and %v resends (the checkpoint covers what was sent)", dup1, dup2, retries1, retries2)
		}
		if int(mapped2) != ld.total()-n1 {
			t.Errorf("the second mapper mapped %v, want exactly the %d that were not mapped yet: it must resume at the checkpoint", mapped2, ld.total()-n1)
		}
		// m2 sent nothing that m1 had sent (the wire sees what OUTGOING drops as a duplicate),
		// each mapper sent nothing twice beyond its own resends, and m2's first publish of each
		// partition is the message right after the checkpoint.
		firstSent := map[int]uint64{}
		acrossMappers, resent := 0, [2]float64{}
		sentBy := map[string]int{} // Msg-Id → the mapper (0: m1, 1: m2) that sent it first
		for i, m := range w.since(-1) {
			p, _, seq := provenance(t, m.Subject, m.Header)
			by := 0
			if i >= m1Sent {
				by = 1
			}
			id := m.Header.Get(nats.MsgIdHdr)
			switch first, ok := sentBy[id]; {
			case !ok:
				sentBy[id] = by
			case first != by:
				acrossMappers++
			default:
				resent[by]++
			}
			if _, ok := firstSent[p]; !ok && by == 1 {
				firstSent[p] = seq
			}
		}
		if acrossMappers > 0 {
			t.Errorf("%d messages m1 had sent were sent again by m2 (seen on the wire), want none across a SIGTERM and restart", acrossMappers)
		}
		if resent[0] > retries1 || resent[1] > retries2 {
			t.Errorf("m1 sent %v messages twice and m2 %v (seen on the wire), beyond their own %v and %v resends", resent[0], resent[1], retries1, retries2)
		}
		for p := 0; p < partitions; p++ {
			i, _ := slices.BinarySearch(in[p], cps[p]+1)
			if i == len(in[p]) {
				continue // nothing of p after the checkpoint
			}
			if firstSent[p] != in[p][i] {
				t.Errorf("partition %d: m2 first published INCOMING sequence %d, want %d, the first after checkpoint %d", p, firstSent[p], in[p][i], cps[p])
			}
		}
		t.Logf("m1 stopped after mapping %d of %d; %d partitions checkpointed midway; m2 mapped %v; resends %v and %v", n1, first, midway, mapped2, retries1, retries2)
	})
}

func TestServerRestartMidStream(t *testing.T) {
	e := newEnv(t)
	devs := e.mappedDevices(100)
	ld := newLoad(t, e.js)
	ld.publish(devs, 150)
	backlog := ld.total()
	// The mapper reaches the server through a proxy, so that the restart strikes with publishes
	// in flight: a server shutting down gracefully answers everything it has read, and one
	// restarted at a random moment often left the lanes nothing to resend (the test then proved
	// nothing). Here the proxy forwards the first thousand of the mapper's publishes to OUTGOING
	// and holds every later one (the rest of what the mapper sends goes through); once it holds
	// 500 more, the server restarts, and what the proxy held is lost with the connection, as it
	// is when a server dies with unread input. The mapper cannot have finished before: the
	// backlog is 15 times what gets through.
	const through, lost = 1000, 500
	px := newProxy(t, "127.0.0.1:"+strconv.Itoa(e.srv.Port()))
	px.HoldAfter("outgoing.", through)
	m := e.startMapper("m1", "--server", px.URL(), "--metrics-listen", "127.0.0.1:0")
	metrics := m.metricsURL()
	heldPubs, held := px.WaitHeld(lost, 60*time.Second)
	if heldPubs < lost {
		t.Fatalf("the proxy holds %d publishes to OUTGOING after the first %d, want %d: the mapper stopped sending", heldPubs, through, lost)
	}
	e.srv = e.srv.Restart()
	natstest.Eventually(t, 10*time.Second, func() error {
		if !e.nc.IsConnected() {
			return fmt.Errorf("test client not reconnected")
		}
		return nil
	})
	m.waitLog("reconnected to NATS", 30*time.Second)
	ld.publish(devs, 50)
	want := each(devs, 200)
	perDevice(t, e.readStream("OUTGOING", 20_000, 90*time.Second), want)
	// The restart must have hit publishes in flight: they failed. The lanes then resend them
	// (retries) or, when the restart outlasted the leases, the next owner of each partition
	// resumes from its checkpoint (OUTGOING drops what was stored as duplicates): either way
	// the check above found every message once and in order.
	failures := metric(t, metrics, "kvmapper_publish_failures_total")[""]
	retries := metric(t, metrics, "kvmapper_publish_retries_total")[""]
	t.Logf("restart after %d of the %d-message backlog had been sent and %d publishes (%d bytes) more lost with the connection: %v publish failures, %v messages resent", through, backlog, heldPubs, held, failures, retries)
	if failures == 0 {
		t.Errorf("%d publishes lost with the connection, kvmapper_publish_failures_total = %v, want > 0: the mapper did not see what it lost", heldPubs, failures)
	}
	m.stop()
}

// The streams layout needs the server's account mapping: setup and run refuse a server without
// it before they map anything, and print the configuration block to add.
func TestStreamsLayoutNeedsTheMapping(t *testing.T) {
	srv := natstest.Start(t)
	block := "mappings {\n  \"incoming.*.*\": \"incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}\"\n}"
	for _, command := range []string{"setup", "run"} {
		// A process, not runCLI: a run that does not refuse would never exit.
		m := startProcess(t, command, command, "--server", srv.URL(), "--layout", "streams", "--log-format", "json")
		select {
		case <-m.done:
		case <-time.After(30 * time.Second):
			t.Fatalf("kvmapper %s --layout streams still runs after 30s against a server without the mapping", command)
		}
		var ee *exec.ExitError
		if !errors.As(m.err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("kvmapper %s: exit %v, want exit status 1\n%s", command, m.err, m.logs)
		}
		for _, want := range []string{block, `nsc add mapping --account <ACCOUNT> --from "incoming.*.*"`, "--layout single"} {
			if !strings.Contains(m.logs.String(), want) {
				t.Errorf("kvmapper %s: output does not say %q:\n%s", command, want, m.logs)
			}
		}
	}
}

func TestQuickStartEmbedded(t *testing.T) {
	for _, layout := range []string{"single", "streams"} {
		t.Run(layout, func(t *testing.T) { quickStart(t, t.TempDir(), layout, "--layout", layout) })
	}
}

// quickStart runs `kvmapper run --embedded` with its data in dir and extra flags, checks that a
// device's message is mapped and is stored where layout (single or streams) keeps it, stops the
// replica and returns its logs.
func quickStart(t *testing.T, dir, layout string, extra ...string) *logBuf {
	t.Helper()
	args := append([]string{"run", "--embedded", "--listen", "127.0.0.1:-1", "--data-dir", dir, "--log-format", "json"}, extra...)
	m := startProcess(t, "embedded", args...)
	url := m.embeddedURL()
	natstest.Eventually(t, 30*time.Second, func() error {
		if !strings.Contains(m.logs.String(), "go tool nats -s "+url+" kv put device-groups dev-42 group-a") {
			return fmt.Errorf("next steps not printed yet")
		}
		return nil
	})
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(context.Background(), "device-groups")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.PutString(context.Background(), "dev-42", "group-a"); err != nil {
		t.Fatal(err)
	}
	sub, err := nc.SubscribeSync("outgoing.>")
	if err != nil {
		t.Fatal(err)
	}
	// The table applies the put asynchronously: publish until one arrives mapped.
	natstest.Eventually(t, 10*time.Second, func() error {
		if err := nc.Publish("incoming.dev-42.temp", []byte(`{"celsius": 21.5}`)); err != nil {
			return err
		}
		msg, err := sub.NextMsg(200 * time.Millisecond)
		if err != nil {
			return err
		}
		if msg.Subject != "outgoing.group-a.dev-42.temp" || string(msg.Data) != `{"celsius": 21.5}` {
			return fmt.Errorf("got %s %q", msg.Subject, msg.Data)
		}
		return nil
	})
	// The device's messages are where the layout keeps them, and the other layout's streams
	// do not exist.
	stream, other := "INCOMING", "INCOMING-"+strconv.Itoa(subjects.Partition("dev-42", 16))
	if layout == "streams" {
		stream, other = other, stream
	}
	s, err := js.Stream(context.Background(), stream)
	if err != nil {
		t.Fatalf("Stream(%s): %v", stream, err)
	}
	if n := s.CachedInfo().State.Msgs; n == 0 {
		t.Errorf("%s holds no message of dev-42", stream)
	}
	if _, err := js.Stream(context.Background(), other); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("Stream(%s) = %v, want not found in the %s layout", other, err, layout)
	}
	nc.Close()
	m.stop()
	return m.logs
}

func waitAtLeast(t *testing.T, e *env, stream string, n int) {
	t.Helper()
	natstest.Eventually(t, 60*time.Second, func() error {
		if got := e.count(stream); got < n {
			return fmt.Errorf("%s holds %d, want %d", stream, got, n)
		}
		return nil
	})
}

// embeddedURL is the URL of the embedded server of `kvmapper run --embedded --listen
// 127.0.0.1:-1`, as it logs it: the server picks a free port, so that no port is reserved by
// closing a listener, which races with other servers starting.
func (m *mapper) embeddedURL() string {
	m.t.Helper()
	url, _ := m.waitLog("embedded NATS server with JetStream started", 30*time.Second)["url"].(string)
	if url == "" {
		m.t.Fatalf("%s logged no url for its embedded server", m.id)
	}
	return url
}
