package replay_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/replay"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const wait = 30 * time.Second

// The replay's templates in most tests: its own first tokens, so that REPLAY captures both.
const (
	replayOut  = "replay.{group}.{device}.{event}"
	replayDead = "replay-unmapped.{device}.{event}"
)

type fixture struct {
	t      *testing.T
	srv    *natstest.Server
	nc     *nats.Conn
	js     jetstream.JetStream
	groups jetstream.KeyValue
	ctl    jetstream.KeyValue
	names  subjects.Names
	next   map[string]int // per device, the number its next message carries
}

// newFixture is a server with kvmapper's streams and buckets in the stream layout sl (the
// partition streams filled by the account mapping, as `kvmapper run --embedded` sets it).
func newFixture(t *testing.T, sl subjects.StreamLayout) *fixture {
	t.Helper()
	srv := natstest.Start(t)
	f := &fixture{t: t, srv: srv, names: subjects.Names{StreamLayout: sl}.WithDefaults(), next: map[string]int{}}
	live := f.layout("outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}")
	if sl == subjects.PartitionStreams {
		if err := srv.GlobalAccount().AddMapping(live.MappingSource(), live.MappingDest()); err != nil {
			t.Fatal(err)
		}
	}
	f.nc, f.js = srv.JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if _, err := setup.Ensure(ctx, f.js, setup.Config{Layout: live, Names: f.names, GroupsHistory: 20}); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	var err error
	if f.groups, err = f.js.KeyValue(ctx, f.names.Groups); err != nil {
		t.Fatal(err)
	}
	if f.ctl, err = f.js.KeyValue(ctx, f.names.Control); err != nil {
		t.Fatal(err)
	}
	return f
}

// eachLayout runs test once per stream layout, each on a server of its own.
func eachLayout(t *testing.T, test func(t *testing.T, f *fixture)) {
	t.Helper()
	for _, sl := range []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams} {
		t.Run(string(sl), func(t *testing.T) { test(t, newFixture(t, sl)) })
	}
}

func (f *fixture) layout(out, dead string) *subjects.Layout {
	f.t.Helper()
	lay, err := subjects.NewLayout("incoming.{device}.{event}", out, dead, 16)
	if err != nil {
		f.t.Fatal(err)
	}
	return lay
}

// put maps device to group and returns the revision.
func (f *fixture) put(device, group string) uint64 {
	f.t.Helper()
	rev, err := f.groups.PutString(context.Background(), device, group)
	if err != nil {
		f.t.Fatalf("Put(%s): %v", device, err)
	}
	return rev
}

// publish sends n messages for each device in turns, payload "<device>:<n>", and waits for them
// to be stored.
func (f *fixture) publish(devices []string, n int) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	var futs []jetstream.PubAckFuture
	for range n {
		for _, d := range devices {
			m := &nats.Msg{Subject: "incoming." + d + ".evt", Data: []byte(d + ":" + strconv.Itoa(f.next[d]))}
			f.next[d]++
			fut, err := f.js.PublishMsgAsync(m)
			if err != nil {
				f.t.Fatal(err)
			}
			futs = append(futs, fut)
		}
	}
	for _, fut := range futs {
		select {
		case <-fut.Ok():
		case err := <-fut.Err():
			f.t.Fatalf("publish: %v", err)
		case <-ctx.Done():
			f.t.Fatal("publishing did not complete")
		}
	}
}

// config is a replay of everything into REPLAY, created on the way, with the replay's own
// templates.
func (f *fixture) config() replay.Config {
	return replay.Config{
		Layout:   f.layout(replayOut, replayDead),
		Names:    f.names,
		Into:     "REPLAY",
		Create:   true,
		FromTime: time.Unix(0, 1),
	}
}

// run runs one replay to its end.
func (f *fixture) run(cfg replay.Config) (replay.Summary, error) {
	f.t.Helper()
	r, err := replay.New(f.js, cfg)
	if err != nil {
		f.t.Fatalf("replay.New: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	err = r.Run(ctx)
	return r.Summary(), err
}

// mustRun runs one replay and fails the test unless it completes.
func (f *fixture) mustRun(cfg replay.Config) replay.Summary {
	f.t.Helper()
	s, err := f.run(cfg)
	if err != nil {
		f.t.Fatalf("Run: %v", err)
	}
	if !s.Complete {
		f.t.Fatalf("Run returned with the replay incomplete: %+v", s)
	}
	return s
}

// read returns every message stream holds, in order (none when it does not exist).
func (f *fixture) read(stream string) []jetstream.Msg {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	s, err := f.js.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil
	}
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	n := int(info.State.Msgs)
	if n == 0 {
		return nil
	}
	cons, err := f.js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		f.t.Fatal(err)
	}
	var out []jetstream.Msg
	for len(out) < n {
		b, err := cons.Fetch(n-len(out), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			f.t.Fatal(err)
		}
		for m := range b.Messages() {
			out = append(out, m)
		}
		if b.Error() != nil && !errors.Is(b.Error(), nats.ErrTimeout) {
			f.t.Fatal(b.Error())
		}
	}
	return out
}

// incomingIDs returns "<stream>:<seq>" for every message of the INCOMING streams, by payload.
func (f *fixture) incoming() map[string]string {
	f.t.Helper()
	out := map[string]string{}
	for _, s := range f.names.IncomingStreams(16) {
		for _, m := range f.read(s) {
			md, err := m.Metadata()
			if err != nil {
				f.t.Fatal(err)
			}
			out[string(m.Data())] = fmt.Sprintf("%s:%d", s, md.Sequence.Stream)
		}
	}
	return out
}

// perDevice checks that msgs hold each device's messages in order, each once, and returns the
// subjects they arrived on, by device.
func perDevice(t *testing.T, msgs []jetstream.Msg) map[string][]string {
	t.Helper()
	got := map[string][]string{}
	for i, m := range msgs {
		dev, num, ok := strings.Cut(string(m.Data()), ":")
		n, err := strconv.Atoi(num)
		if !ok || err != nil {
			t.Fatalf("message %d (%s): payload %q not from this test", i, m.Subject(), m.Data())
		}
		if n != len(got[dev]) {
			t.Fatalf("message %d (%s): device %s message %d arrived after %d of its messages: reordered, duplicated or lost",
				i, m.Subject(), dev, n, len(got[dev]))
		}
		got[dev] = append(got[dev], m.Subject())
	}
	return got
}

// seqOf returns the INCOMING sequence a replayed message's Nats-Msg-Id names.
func seqOf(t *testing.T, m jetstream.Msg) string {
	t.Helper()
	id := m.Headers().Get(nats.MsgIdHdr)
	i := strings.LastIndexByte(id, ':')
	if !strings.HasPrefix(id, "replay:") || i < 0 {
		t.Fatalf("message %s has Nats-Msg-Id %q, not a replay's", m.Subject(), id)
	}
	return id
}

func devices(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%02d", prefix, i)
	}
	return out
}
