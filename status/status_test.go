package status_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/status"
	"github.com/kvmapper/kvmapper/subjects"
)

const partitions = 16

func layout(t testing.TB) *subjects.Layout {
	t.Helper()
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", partitions)
	if err != nil {
		t.Fatal(err)
	}
	return lay
}

// env is a server with the streams and buckets setup creates.
type env struct {
	srv *natstest.Server
	nc  *nats.Conn
	js  jetstream.JetStream
	ctl jetstream.KeyValue
	grp jetstream.KeyValue
	// names say how INCOMING is stored.
	names subjects.Names
}

func newEnv(t testing.TB) *env { return newEnvIn(t, subjects.SingleStream) }

// newEnvIn is newEnv in the stream layout sl; for the partition streams, the server maps the
// device subjects into them.
func newEnvIn(t testing.TB, sl subjects.StreamLayout) *env {
	t.Helper()
	e := &env{srv: natstest.Start(t), names: subjects.Names{StreamLayout: sl}.WithDefaults()}
	if sl == subjects.PartitionStreams {
		if err := e.srv.GlobalAccount().AddMapping(layout(t).MappingSource(), layout(t).MappingDest()); err != nil {
			t.Fatal(err)
		}
	}
	e.nc, e.js = e.srv.JetStream(t)
	ctx := context.Background()
	if _, err := setup.Ensure(ctx, e.js, setup.Config{Layout: layout(t), Names: e.names}); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	var err error
	if e.ctl, err = e.js.KeyValue(ctx, "kvmapper"); err != nil {
		t.Fatal(err)
	}
	if e.grp, err = e.js.KeyValue(ctx, "device-groups"); err != nil {
		t.Fatal(err)
	}
	return e
}

// runService runs s until the test ends.
func runService(t *testing.T, s *status.Service) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Service.Run() = %v, want nil", err)
		}
	})
}

func newService(t *testing.T, nc *nats.Conn, id string, report func() status.Report) *status.Service {
	t.Helper()
	s, err := status.NewService(nc, report, status.ServiceConfig{Replica: id, Control: "kvmapper", Host: "host-" + id, Version: "dev"})
	if err != nil {
		t.Fatalf("NewService: %v", err)
	}
	runService(t, s)
	return s
}

func TestServiceAnswersOnItsOwnSubject(t *testing.T) {
	e := newEnv(t)
	for _, id := range []string{"r0", "r1"} {
		newService(t, e.srv.Connect(t), id, func() status.Report {
			return status.Report{Ready: true, Owned: []int{3}, Partitions: []status.PartitionReport{{Partition: 3, Epoch: 7, Lag: 2}}}
		})
	}
	for _, id := range []string{"r0", "r1"} {
		var rep status.Report
		natstest.Eventually(t, 5*time.Second, func() error {
			m, err := e.nc.Request(status.StatusSubject("kvmapper", id), nil, time.Second)
			if err != nil {
				return err
			}
			return json.Unmarshal(m.Data, &rep)
		})
		if rep.Replica != id || rep.Host != "host-"+id || rep.Version != "dev" || !rep.Ready {
			t.Errorf("report of %s = %+v, want its identity and ready", id, rep)
		}
		if len(rep.Partitions) != 1 || rep.Partitions[0].Epoch != 7 || rep.UptimeSeconds <= 0 {
			t.Errorf("report of %s: partitions %+v, uptime %v", id, rep.Partitions, rep.UptimeSeconds)
		}
	}

	// Every instance shows in micro's discovery, with SemVer and its replica id.
	sub, err := e.nc.SubscribeSync(nats.NewInbox())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	subject, _ := micro.ControlSubject(micro.InfoVerb, status.ServiceName, "")
	if err := e.nc.PublishRequest(subject, sub.Subject, nil); err != nil {
		t.Fatal(err)
	}
	seen := map[string]micro.Info{}
	for len(seen) < 2 {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("waiting for micro INFO replies (have %d): %v", len(seen), err)
		}
		var info micro.Info
		if err := json.Unmarshal(m.Data, &info); err != nil {
			t.Fatal(err)
		}
		seen[info.Metadata["replica"]] = info
	}
	for id, info := range seen {
		if info.Version != "0.0.0-dev" || len(info.Endpoints) != 1 {
			t.Fatalf("INFO of %s: version %q, endpoints %+v", id, info.Version, info.Endpoints)
		}
		ep := info.Endpoints[0]
		if ep.Subject != status.StatusSubject("kvmapper", id) || ep.QueueGroup != "" {
			t.Errorf("endpoint of %s: subject %q queue group %q, want %q and none", id, ep.Subject, ep.QueueGroup, status.StatusSubject("kvmapper", id))
		}
	}
}

func TestNewServiceRejectsMissingIdentity(t *testing.T) {
	e := newEnv(t)
	_, err := status.NewService(e.nc, func() status.Report { return status.Report{} }, status.ServiceConfig{Control: "kvmapper"})
	if !errors.Is(err, status.ErrInvalidConfig) {
		t.Fatalf("NewService(no replica) = %v, want ErrInvalidConfig", err)
	}
}

// TestRead writes the control bucket the way replicas do, runs the status service of one of
// the two owners, and checks what Read makes of it, in both stream layouts.
func TestRead(t *testing.T) {
	for _, sl := range []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams} {
		t.Run(string(sl), func(t *testing.T) { testRead(t, newEnvIn(t, sl)) })
	}
}

func testRead(t *testing.T, e *env) {
	ctx := context.Background()
	lay := layout(t)

	// 40 devices, 5 messages each: remember each partition's sequences.
	seqs := map[int][]uint64{}
	for d := range 40 {
		dev := fmt.Sprintf("dev-%02d", d)
		if _, err := e.grp.PutString(ctx, dev, "g"); err != nil {
			t.Fatal(err)
		}
		for range 5 {
			ack, err := e.js.Publish(ctx, "incoming."+dev+".t", []byte("x"))
			if err != nil {
				t.Fatal(err)
			}
			p := subjects.Partition(dev, partitions)
			seqs[p] = append(seqs[p], ack.Sequence)
		}
	}
	// Partitions 0-7 to r0, 8-14 to r1, 15 unowned; every checkpoint at the partition's 2nd
	// message, 14's in an earlier incarnation of its stream.
	checkpoint := map[int]uint64{}
	for p := range partitions {
		owner := "r0"
		if p >= 8 {
			owner = "r1"
		}
		if p < 15 {
			if _, err := e.ctl.Create(ctx, "lease."+strconv.Itoa(p), []byte(owner), jetstream.KeyTTL(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}
		if len(seqs[p]) > 1 {
			checkpoint[p] = seqs[p][1]
		}
		value := strconv.FormatUint(checkpoint[p], 10)
		if p == 14 {
			value = "earlier:" + value
		}
		if _, err := e.ctl.PutString(ctx, "checkpoint."+strconv.Itoa(p), value); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"r0", "r1"} {
		if _, err := e.ctl.PutString(ctx, "member."+id, id); err != nil {
			t.Fatal(err)
		}
	}
	// Only r0 answers; it reports a lag of 1000+p, which is not what the stream would say, and
	// partition 5 waiting for OUTGOING since 12 s before the read.
	waitSince := time.Now().Add(-12 * time.Second)
	newService(t, e.srv.Connect(t), "r0", func() status.Report {
		r := status.Report{Ready: true, Owned: []int{0, 1, 2, 3, 4, 5, 6, 7}}
		for p := range 8 {
			r.Partitions = append(r.Partitions, status.PartitionReport{Partition: p, Epoch: uint64(100 + p), Acked: checkpoint[p], Lag: uint64(1000 + p)})
		}
		r.Partitions[5].Waiting = &status.Waiting{For: "publish", Stream: "OUTGOING", Server: "n2", Since: waitSince}
		return r
	})
	natstest.Eventually(t, 5*time.Second, func() error {
		_, err := e.nc.Request(status.StatusSubject("kvmapper", "r0"), nil, time.Second)
		return err
	})

	snap, err := status.Read(ctx, e.js, status.ReadConfig{Layout: lay, Names: e.names, Timeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	if len(snap.Partitions) != partitions {
		t.Fatalf("Read: %d partitions, want %d", len(snap.Partitions), partitions)
	}
	for _, p := range snap.Partitions {
		wantOwner, wantLag, wantFrom := "r0", uint64(1000+p.Partition), "replica"
		if p.Partition >= 8 {
			wantOwner, wantFrom = "r1", "stream"
			wantLag = 0
			for _, s := range seqs[p.Partition] {
				if s > checkpoint[p.Partition] || p.Partition == 14 {
					wantLag++
				}
			}
		}
		if p.StaleCheckpoint != (p.Partition == 14) {
			t.Errorf("partition %d: stale checkpoint %v, want %v", p.Partition, p.StaleCheckpoint, p.Partition == 14)
		}
		if p.Partition == 15 {
			wantOwner = ""
		}
		if p.Owner != wantOwner || p.Checkpoint != checkpoint[p.Partition] || p.Lag != wantLag || p.LagFrom != wantFrom {
			t.Errorf("partition %d: owner %q checkpoint %d lag %d from %q; want %q %d %d %q",
				p.Partition, p.Owner, p.Checkpoint, p.Lag, p.LagFrom, wantOwner, checkpoint[p.Partition], wantLag, wantFrom)
		}
		if wantOwner == "r0" && p.Epoch != uint64(100+p.Partition) {
			t.Errorf("partition %d: epoch %d, want the owner's %d", p.Partition, p.Epoch, 100+p.Partition)
		}
	}
	if len(snap.Replicas) != 2 || snap.Replicas[0].Report == nil || snap.Replicas[1].Error == "" {
		t.Fatalf("Read replicas = %+v, want r0 with a report and r1 with an error", snap.Replicas)
	}
	if got := len(snap.Replicas[1].Leases); got != 7 {
		t.Errorf("r1 leases = %d, want 7", got)
	}
	if snap.Groups.Values != 40 || snap.Groups.Revision != 40 {
		t.Errorf("groups = %+v, want 40 values, revision 40", snap.Groups)
	}
	want := []string{"PARTITION", "OWNER", "CHECKPOINT", "REPLICA", "host-r0", "replica r1 did not report", "unowned partitions: 15",
		"groups bucket device-groups: 40 values", "partitions 14: checkpoint of an earlier INCOMING"}
	if e.names.StreamLayout == subjects.SingleStream {
		if snap.Incoming.Messages != 200 || snap.Incoming.LastSeq != 200 || len(snap.Streams) != 0 {
			t.Errorf("incoming = %+v, streams %+v, want 200 messages in INCOMING", snap.Incoming, snap.Streams)
		}
	} else {
		if snap.Incoming.Messages != 200 || snap.Incoming.Name != "INCOMING-<p>" || len(snap.Streams) != partitions || snap.StreamLayout != "streams" {
			t.Fatalf("incoming = %+v, %d streams, layout %q; want 200 messages over %d partition streams", snap.Incoming, len(snap.Streams), snap.StreamLayout, partitions)
		}
		for p, st := range snap.Streams {
			if s := seqs[p]; st.Name != fmt.Sprintf("INCOMING-%d", p) || st.Messages != uint64(len(s)) || len(s) > 0 && st.LastSeq != s[len(s)-1] {
				t.Errorf("streams[%d] = %+v, want INCOMING-%d with %d messages up to %v", p, st, p, len(s), s)
			}
		}
		want = append(want, "partition streams INCOMING-<p>: 200 messages in all", "STREAM", fmt.Sprintf("INCOMING-15  %d", len(seqs[15])))
	}
	// Every stream's replication: one copy each, on this server.
	names := status.StreamNames(e.names, partitions)
	if len(snap.Replication) != len(names) {
		t.Errorf("Read replication of %d streams, want %d (%v)", len(snap.Replication), len(names), names)
	}
	for i, r := range snap.Replication {
		if r.Stream != names[i] || r.Replicas != 1 || r.Error != "" || len(r.Followers) != 0 || !r.Healthy() {
			t.Errorf("replication[%d] = %+v, want %s with 1 replica, no followers, healthy", i, r, names[i])
		}
	}
	want = append(want, "REPLICAS", "FOLLOWERS", "KV_device-groups")
	// How the lanes write the output streams setup made: in fast-ingest batches, one server.
	for _, r := range snap.Replication {
		want := ""
		if r.Stream == "OUTGOING" || r.Stream == "UNMAPPED" {
			want = "batch"
		}
		if r.WriteMode != want {
			t.Errorf("replication of %s: WriteMode %q, want %q", r.Stream, r.WriteMode, want)
		}
	}
	want = append(want, "the lanes write OUTGOING in fast-ingest batches, UNMAPPED in fast-ingest batches\n")
	// The lag count leaves no consumer behind.
	for _, name := range e.names.IncomingStreams(partitions) {
		info, err := e.js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if si, err := info.Info(ctx); err != nil || si.State.Consumers != 0 {
			t.Errorf("%s consumers after Read = %d (%v), want 0", name, si.State.Consumers, err)
		}
	}

	// The wait of partition 5, and of no other.
	for _, p := range snap.Partitions {
		switch w := p.Waiting; {
		case p.Partition == 5 && (w == nil || w.For != "publish" || w.Stream != "OUTGOING" || w.Server != "n2" || !w.Since.Equal(waitSince)):
			t.Errorf("partition 5 waiting %+v, want for OUTGOING on n2 since %v", w, waitSince)
		case p.Partition != 5 && w != nil:
			t.Errorf("partition %d waiting %+v, want nothing", p.Partition, w)
		}
	}
	want = append(want, "partition 5 has waited 12", "s for OUTGOING to store its publishes on server n2, since "+waitSince.UTC().Format("15:04:05.0"))

	var buf bytes.Buffer
	if err := snap.WriteText(&buf); err != nil {
		t.Fatal(err)
	}
	for _, want := range want {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("WriteText output lacks %q:\n%s", want, buf.String())
		}
	}
	if n := strings.Count(buf.String(), "has waited"); n != 1 {
		t.Errorf("WriteText shows %d waits, want 1:\n%s", n, buf.String())
	}
}

func TestSetRates(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	prev := &status.Snapshot{At: at, Partitions: []status.Partition{{Partition: 0, Checkpoint: 100}, {Partition: 1, Acked: 50}}}
	cur := &status.Snapshot{At: at.Add(2 * time.Second), Partitions: []status.Partition{{Partition: 0, Checkpoint: 300}, {Partition: 1, Checkpoint: 40}}}
	cur.SetRates(prev)
	if r := cur.Partitions[0].Rate; r == nil || *r != 100 {
		t.Errorf("partition 0 rate = %v, want 100", r)
	}
	if r := cur.Partitions[1].Rate; r != nil {
		t.Errorf("partition 1 rate = %v, want none (went back)", *r)
	}
}

func TestEvents(t *testing.T) {
	e := newEnv(t)
	sub, err := e.nc.SubscribeSync("kvmapper.events.ownership")
	if err != nil {
		t.Fatal(err)
	}
	// The events publish on another connection: the server must have the interest first.
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ev, err := status.NewEvents(e.srv.Connect(t), status.EventsConfig{
		Subject:   status.DefaultEventsSubject,
		Replica:   "r1",
		Buffer:    2,
		ResumeSeq: func(_ context.Context, p int) (uint64, error) { return uint64(10 * p), nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	at := time.Now().UTC().Truncate(time.Millisecond)
	// Not running yet: the third offer does not fit.
	for p := range 3 {
		ok := ev.Offer(status.Event{Partition: p, OldOwner: "r0", NewOwner: "r1", Epoch: 9, UnownedGapMS: 1200, At: at})
		if ok != (p < 2) {
			t.Errorf("Offer(%d) = %v, want %v", p, ok, p < 2)
		}
	}
	if ev.Dropped() != 1 {
		t.Errorf("Dropped() = %d, want 1", ev.Dropped())
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ev.Run(ctx) }()
	for p := range 2 {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("event %d: %v", p, err)
		}
		var got status.Event
		if err := json.Unmarshal(m.Data, &got); err != nil {
			t.Fatal(err)
		}
		want := status.Event{Partition: p, OldOwner: "r0", NewOwner: "r1", Epoch: 9, ResumeSeq: uint64(10 * p), UnownedGapMS: 1200, At: at, Replica: "r1"}
		if got != want {
			t.Errorf("event = %+v, want %+v", got, want)
		}
	}
	// Events offered while Run stops are still sent.
	ev.Offer(status.Event{Partition: 5, OldOwner: "r1"})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Events.Run() = %v, want nil", err)
	}
	if m, err := sub.NextMsg(5 * time.Second); err != nil || !strings.Contains(string(m.Data), `"partition":5`) {
		t.Errorf("event offered while stopping: %v, want it published", err)
	}
	if ev.Published() != 3 {
		t.Errorf("Published() = %d, want 3", ev.Published())
	}
}
