package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// groups is a device → value table for tests, decoding values as package kv does.
type groups struct {
	mu     sync.RWMutex
	m      map[string]string
	schema *subjects.Schema // nil: subjects.GroupSchema
}

func (g *groups) set(device, group string) {
	g.mu.Lock()
	g.m[device] = group
	g.mu.Unlock()
}

func (g *groups) lookup(device string) subjects.Mapping {
	g.mu.RLock()
	v, ok := g.m[device]
	sc := g.schema
	g.mu.RUnlock()
	if !ok {
		return subjects.Unmappable(wire.ReasonNoMapping, "", "", 0)
	}
	return kv.DecodeEntry(sc, []byte(v), 7).Mapping()
}

type fixture struct {
	t      testing.TB
	srv    *natstest.Server
	nc     *nats.Conn
	js     jetstream.JetStream
	ctl    jetstream.KeyValue
	lay    *subjects.Layout
	groups *groups
	// names say how INCOMING is stored: one stream, or one per partition.
	names subjects.Names
	// padding, when set, is appended to the payloads publish makes, after a colon.
	padding []byte
	// recreated counts, per partition, the runs of runAll that ended with ErrIncomingRecreated.
	recreated []atomic.Int64
}

// newFixture is a server, streams and buckets in the single-stream layout.
func newFixture(t testing.TB) *fixture { return newFixtureIn(t, subjects.SingleStream) }

// newFixtureIn is a server, streams and buckets in the stream layout sl. For the
// partition-streams layout the server's global account maps the device subjects into the
// partitions, as `kvmapper run --embedded` configures its own server.
func newFixtureIn(t testing.TB, sl subjects.StreamLayout) *fixture {
	t.Helper()
	srv := natstest.Start(t)
	f := &fixture{t: t, srv: srv, groups: &groups{m: map[string]string{}},
		names: subjects.Names{StreamLayout: sl}.WithDefaults()}
	f.connect()
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	f.lay = lay
	f.mapIncoming()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := setup.Ensure(ctx, f.js, f.setupConfig()); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	if f.ctl, err = f.js.KeyValue(ctx, "kvmapper"); err != nil {
		t.Fatal(err)
	}
	return f
}

// eachLayout runs test as one subtest per stream layout, each on a fixture of its own.
func eachLayout(t *testing.T, test func(t *testing.T, f *fixture)) {
	t.Helper()
	for _, sl := range []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams} {
		t.Run(string(sl), func(t *testing.T) { test(t, newFixtureIn(t, sl)) })
	}
}

// mapIncoming gives the server the account mapping the partition-streams layout needs.
func (f *fixture) mapIncoming() {
	f.t.Helper()
	if f.names.StreamLayout != subjects.PartitionStreams {
		return
	}
	if err := f.srv.GlobalAccount().AddMapping(f.lay.MappingSource(), f.lay.MappingDest()); err != nil {
		f.t.Fatalf("AddMapping: %v", err)
	}
}

// restart restarts the server as an operator would, its configuration (the mapping) included.
func (f *fixture) restart() {
	f.t.Helper()
	f.srv = f.srv.Restart()
	f.mapIncoming()
}

func (f *fixture) setupConfig() setup.Config {
	return setup.Config{Layout: f.lay, Names: f.names}
}

// config is c with the fixture's layout and stream layout.
// config is c on the fixture's layout, logging to stderr when KVMAPPER_TEST_LOG names a level.
func (f *fixture) config(c lanes.Config) lanes.Config {
	c.Layout, c.Incoming, c.StreamLayout = f.lay, f.names.Incoming, f.names.StreamLayout
	if os.Getenv("KVMAPPER_TEST_LOG") != "" {
		lvl, _ := zerolog.ParseLevel(os.Getenv("KVMAPPER_TEST_LOG"))
		c.Logger = zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr}).Level(lvl).With().Timestamp().Logger()
	}
	return c
}

// stream is the stream that holds device's messages.
func (f *fixture) stream(device string) string {
	s, _ := f.names.IncomingStream(f.lay, subjects.Partition(device, f.lay.Partitions))
	return s
}

func (f *fixture) connect() {
	f.t.Helper()
	f.nc, f.js = f.srv.JetStream(f.t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1))
}

// newPool returns a pool on the fixture's layout, with a 20ms checkpoint interval unless cfg
// sets one (see [fixture.config]).
func (f *fixture) newPool(cfg lanes.Config) *lanes.Pool {
	f.t.Helper()
	cfg = f.config(cfg)
	if cfg.CheckpointInterval == 0 {
		cfg.CheckpointInterval = 20 * time.Millisecond
	}
	pool, err := lanes.New(f.js, f.ctl, f.groups.lookup, cfg)
	if err != nil {
		f.t.Fatalf("lanes.New: %v", err)
	}
	return pool
}

// run starts a pool with every partition, each under its own Valid func, and returns a stop
// func that cancels them and returns what each Run returned.
func (f *fixture) run(cfg lanes.Config, valid func(p int) bool) (*lanes.Pool, func() map[int]error) {
	f.t.Helper()
	return f.runPool(f.newPool(cfg), valid)
}

// runPool is run with a pool of the caller's.
func (f *fixture) runPool(pool *lanes.Pool, valid func(p int) bool) (*lanes.Pool, func() map[int]error) {
	f.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	errs := map[int]error{}
	for p := 0; p < f.lay.Partitions; p++ {
		a := lanes.Assignment{Partition: p, Epoch: uint64(100 + p)}
		if valid != nil {
			a.Valid = func() bool { return valid(p) }
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := pool.Run(ctx, a)
			mu.Lock()
			errs[p] = err
			mu.Unlock()
		}()
	}
	var once sync.Once
	stop := func() map[int]error {
		once.Do(func() {
			cancel()
			wg.Wait()
		})
		return errs
	}
	f.t.Cleanup(func() { stop() })
	return pool, stop
}

// publish publishes n messages per device in turns, payloads "<device>:0" to "<device>:n-1".
func (f *fixture) publish(devices []string, n int, hdr nats.Header) {
	f.t.Helper()
	f.publishFrom(devices, 0, n, hdr)
}

// publishFrom publishes payloads "<device>:from" to "<device>:from+n-1", in turns.
func (f *fixture) publishFrom(devices []string, from, n int, hdr nats.Header) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var futs []jetstream.PubAckFuture
	for i := from; i < from+n; i++ {
		for _, d := range devices {
			data := []byte(d + ":" + strconv.Itoa(i))
			if f.padding != nil {
				data = append(append(data, ':'), f.padding...)
			}
			m := &nats.Msg{Subject: "incoming." + d + ".evt", Data: data, Header: hdr}
			fut, err := f.js.PublishMsgAsync(m)
			if err != nil {
				f.t.Fatalf("PublishMsgAsync: %v", err)
			}
			futs = append(futs, fut)
			if len(futs) == 1000 {
				f.settle(ctx, futs)
				futs = futs[:0]
			}
		}
	}
	f.settle(ctx, futs)
}

func (f *fixture) settle(ctx context.Context, futs []jetstream.PubAckFuture) {
	f.t.Helper()
	for _, fut := range futs {
		select {
		case <-fut.Ok():
		case err := <-fut.Err():
			f.t.Fatalf("publish to INCOMING: %v", err)
		case <-ctx.Done():
			f.t.Fatal("publishing to INCOMING did not complete")
		}
	}
}

// read returns every message of stream in order, waiting until it holds want of them, and fails
// the test if it then holds more: a message stored twice, or one that should not be there, is
// not left unread past want.
func (f *fixture) read(stream string, want int) []jetstream.Msg {
	f.t.Helper()
	out := f.readFirst(stream, want)
	if n, err := f.tryCount(stream); err == nil && n > want {
		extra := f.readFirst(stream, n)[want:]
		var shown []string
		for _, m := range extra[:min(len(extra), 5)] {
			shown = append(shown, fmt.Sprintf("%s %q", m.Subject(), m.Data()))
		}
		f.t.Fatalf("%s holds %d messages, want %d; the first beyond: %s", stream, n, want, strings.Join(shown, ", "))
	}
	return out
}

// readFirst returns the first n messages of stream in order, waiting until it holds n: for a
// test that looks at a prefix while more is on its way.
func (f *fixture) readFirst(stream string, n int) []jetstream.Msg {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	f.atLeast(stream, n)
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

// atLeast waits until stream holds n messages or more.
func (f *fixture) atLeast(stream string, n int) {
	f.t.Helper()
	natstest.Eventually(f.t, 60*time.Second, func() error {
		got, err := f.tryCount(stream)
		if err != nil {
			return err
		}
		if got < n {
			return fmt.Errorf("%s holds %d messages, want %d", stream, got, n)
		}
		return nil
	})
}

// checkOrder checks that msgs hold, for each device, exactly payloads "<device>:0" to
// "<device>:n-1" in order (each maybe followed by ":" and padding), on subjects made by
// subject(device), and nothing else.
func checkOrder(t *testing.T, msgs []jetstream.Msg, devices []string, n int, subject func(device string) string) {
	t.Helper()
	next := map[string]int{}
	for _, d := range devices {
		next[d] = 0
	}
	for i, m := range msgs {
		dev, num, ok := strings.Cut(string(m.Data()), ":")
		want, known := next[dev]
		if !ok || !known {
			t.Fatalf("message %d: payload %q from no device of the test", i, m.Data())
		}
		num, _, _ = strings.Cut(num, ":")
		got, _ := strconv.Atoi(num)
		if got != want {
			t.Fatalf("message %d: device %s payload %d, want %d (reordered, duplicated or lost)", i, dev, got, want)
		}
		if s := subject(dev); m.Subject() != s {
			t.Fatalf("message %d: subject %q, want %q", i, m.Subject(), s)
		}
		next[dev] = want + 1
	}
	for _, d := range devices {
		if next[d] != n {
			t.Fatalf("device %s: %d messages, want %d", d, next[d], n)
		}
	}
}

func devices(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("dev-%03d", i)
	}
	return out
}

// checkpoint returns partition p's checkpoint. A read that fails (just after a server restart
// one may time out) is made again, for up to 10 s.
func (f *fixture) checkpoint(p int) uint64 {
	f.t.Helper()
	var seq uint64
	natstest.Eventually(f.t, 10*time.Second, func() error {
		e, err := f.ctl.Get(context.Background(), wire.CheckpointKey(p))
		if err != nil {
			return fmt.Errorf("Get(%s): %w", wire.CheckpointKey(p), err)
		}
		cp, err := wire.ParseCheckpoint(e.Value())
		if err != nil {
			return err
		}
		seq = cp.Seq
		return nil
	})
	return seq
}

// checkReaders checks that each partition's lane reads as its stream layout says: one consumer
// filtered on its partition on INCOMING, or one unfiltered consumer on INCOMING-<p>.
func (f *fixture) checkReaders() {
	f.t.Helper()
	ctx := context.Background()
	want := map[string][]string{}
	for p := range f.lay.Partitions {
		stream, filter := f.names.IncomingStream(f.lay, p)
		want[stream] = append(want[stream], filter)
	}
	for stream, filters := range want {
		s, err := f.js.Stream(ctx, stream)
		if err != nil {
			f.t.Fatal(err)
		}
		var got []string
		cs := s.ListConsumers(ctx)
		for ci := range cs.Info() {
			got = append(got, strings.Join(append([]string{ci.Config.FilterSubject}, ci.Config.FilterSubjects...), ""))
		}
		if err := cs.Err(); err != nil {
			f.t.Fatal(err)
		}
		slices.Sort(got)
		slices.Sort(filters)
		if !slices.Equal(got, filters) {
			f.t.Errorf("consumers of %s filter on %q, want %q", stream, got, filters)
		}
	}
}

// lastSeq is the sequence of partition p's last message in the stream that holds it.
func (f *fixture) lastSeq(p int) uint64 {
	f.t.Helper()
	stream, _ := f.names.IncomingStream(f.lay, p)
	s, err := f.js.Stream(context.Background(), stream)
	if err != nil {
		f.t.Fatal(err)
	}
	m, err := s.GetLastMsgForSubject(context.Background(), f.lay.Filter(p))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0
	}
	if err != nil {
		f.t.Fatalf("GetLastMsgForSubject(%s): %v", f.lay.Filter(p), err)
	}
	return m.Sequence
}

// waitOrDump waits until stream holds want messages and, if it does not within timeout, fails
// with what every lane and stream says about itself.
func (f *fixture) waitOrDump(pool *lanes.Pool, stream string, want uint64, timeout time.Duration) {
	f.t.Helper()
	count := func(name string) uint64 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s, err := f.js.Stream(ctx, name)
		if err != nil {
			return 0
		}
		info, err := s.Info(ctx)
		if err != nil {
			return 0
		}
		return info.State.Msgs
	}
	deadline := time.Now().Add(timeout)
	for count(stream) < want {
		if time.Now().After(deadline) {
			var incoming uint64
			for _, s := range f.names.IncomingStreams(f.lay.Partitions) {
				incoming += count(s)
			}
			f.t.Fatalf("%s holds %d of %d after %v; UNMAPPED %d; INCOMING %d\nstats %+v\nlanes %+v",
				stream, count(stream), want, timeout, count("UNMAPPED"), incoming, pool.Stats(), pool.Partitions())
		}
		timer := time.NewTimer(20 * time.Millisecond)
		<-timer.C
	}
}

// epochOf returns the lease epoch a message's provenance names, "" when none.
func epochOf(h nats.Header) string {
	if pv, _ := wire.ReadProvenance(h.Get); pv.Epoch != 0 {
		return strconv.FormatUint(pv.Epoch, 10)
	}
	return ""
}
