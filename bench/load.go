package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// publishWindow bounds the bench's own unacknowledged JetStream publishes, far below the
// server's per-stream ingest queue.
const publishWindow = 4096

// stall lets a publish wait for room in the window instead of failing after nats.go's 200ms.
var stall = []jetstream.PublishOpt{jetstream.WithStallWait(30 * time.Second)}

// incoming names the streams that hold INCOMING messages in the bench's stream layout.
func (e *env) incoming() subjects.Names {
	return subjects.Names{Incoming: incomingStream, StreamLayout: e.cfg.StreamLayout}.WithDefaults()
}

// incomingState sums the state of the streams holding INCOMING messages: the messages they
// hold, and their last sequences, which count every message ever stored (the bench only purges).
func (e *env) incomingState(ctx context.Context) (msgs, last uint64, err error) {
	for _, name := range e.incoming().IncomingStreams(e.cfg.Partitions) {
		info, err := e.streamInfo(ctx, name)
		if err != nil {
			return 0, 0, err
		}
		msgs, last = msgs+info.State.Msgs, last+info.State.LastSeq
	}
	return msgs, last, nil
}

// createIncoming creates INCOMING as kvmapper's setup would (partition stamped on ingest, or one
// stream per partition whose mapping it checks) and the groups bucket with every device mapped,
// unless they exist.
func (e *env) createIncoming(ctx context.Context) error {
	names := e.incoming()
	for p, name := range names.IncomingStreams(e.cfg.Partitions) {
		cfg := jetstream.StreamConfig{
			Name:     name,
			Subjects: []string{e.lay.StreamSubject()},
			SubjectTransform: &jetstream.SubjectTransformConfig{
				Source: e.lay.TransformSource(), Destination: e.lay.TransformDest(),
			},
			Storage:   jetstream.FileStorage,
			Retention: jetstream.LimitsPolicy,
			Replicas:  e.cfg.StreamReplicas,
		}
		if names.StreamLayout == subjects.PartitionStreams {
			cfg.Subjects, cfg.SubjectTransform = []string{e.lay.Filter(p)}, nil
		}
		_, err := e.js.CreateStream(ctx, cfg)
		if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return fmt.Errorf("creating %s: %w", name, err)
		}
	}
	if names.StreamLayout == subjects.PartitionStreams {
		if err := setup.CheckMapping(ctx, e.js, setup.Config{Layout: e.lay, Names: names}); err != nil {
			return err
		}
	}
	kv, err := e.js.KeyValue(ctx, groupsBucket)
	if err == nil {
		if st, err := kv.Status(ctx); err == nil && st.Values() >= uint64(len(e.devices)) {
			return nil
		}
	}
	if _, err := e.js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: groupsBucket, History: 5, Storage: jetstream.FileStorage, Replicas: e.cfg.StreamReplicas}); err != nil {
		return fmt.Errorf("creating bucket %s: %w", groupsBucket, err)
	}
	return e.putKeys(ctx, groupsBucket, len(e.devices), func(i int) (string, string) { return e.devices[i], e.groupOf[i] })
}

// putKeys writes n keys to bucket with pipelined publishes, which is how a large bucket is loaded
// in seconds rather than minutes.
func (e *env) putKeys(ctx context.Context, bucket string, n int, kv func(i int) (key, value string)) error {
	prefix := "$KV." + bucket + "."
	for i := range n {
		k, v := kv(i)
		if _, err := e.js.PublishAsync(prefix+k, []byte(v), stall...); err != nil {
			return fmt.Errorf("putting %s into %s: %w", k, bucket, err)
		}
		if i%50_000 == 0 {
			e.prog.show("loading bucket %s: %d/%d keys", bucket, i, n)
		}
	}
	return e.complete(ctx)
}

// complete waits until every async publish of e.js is acknowledged.
func (e *env) complete(ctx context.Context) error {
	select {
	case <-e.js.PublishAsyncComplete():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(60 * time.Second):
		return errors.New("publishes not acknowledged within 60s")
	}
}

// payload returns a message body of the configured size carrying the time t.
func (e *env) payload(buf []byte, t time.Time) []byte {
	buf = buf[:e.cfg.Payload]
	binary.LittleEndian.PutUint64(buf, uint64(t.UnixNano()))
	return buf
}

func stamp(data []byte) (time.Time, bool) {
	if len(data) < 8 {
		return time.Time{}, false
	}
	return time.Unix(0, int64(binary.LittleEndian.Uint64(data))), true
}

// fill publishes n messages into INCOMING, devices in turn, and waits until all are stored.
// It returns the rate the server stored them at.
func (e *env) fill(ctx context.Context, n int) (float64, error) {
	before, _, err := e.incomingState(ctx)
	if err != nil {
		return 0, err
	}
	buf := make([]byte, e.cfg.Payload)
	for i := range buf {
		buf[i] = byte('a' + i%26)
	}
	subjects := make([]string, len(e.devices))
	for i, d := range e.devices {
		subjects[i] = "incoming." + d + "." + event
	}
	start := time.Now()
	for i := range n {
		if _, err := e.js.PublishAsync(subjects[i%len(subjects)], e.payload(buf, time.Now()), stall...); err != nil {
			return 0, fmt.Errorf("publishing into %s: %w", incomingStream, err)
		}
		if i%20_000 == 0 {
			e.prog.show("filling %s: %d/%d messages", incomingStream, i, n)
		}
	}
	if err := e.complete(ctx); err != nil {
		return 0, err
	}
	elapsed := time.Since(start)
	after, _, err := e.incomingState(ctx)
	if err != nil {
		return 0, err
	}
	if got := after - before; got != uint64(n) {
		return 0, fmt.Errorf("%s stored %d of the %d messages published", incomingStream, got, n)
	}
	return float64(n) / elapsed.Seconds(), nil
}

// waited is what waitCount saw: the first poll with any message, and when the count reached want.
type waited struct {
	first    time.Time // first poll that saw a message
	firstN   uint64    // how many it saw
	done     time.Time // first poll that saw want
	startup  time.Duration
	rate     float64 // (want-firstN)/(done-first): the steady rate, without the startup
	messages uint64
}

// waitCount polls stream until it holds want messages, showing progress. It fails when the count
// stops moving for stuckAfter.
func (e *env) waitCount(ctx context.Context, stream string, want uint64, since time.Time, what string) (waited, error) {
	var w waited
	s, err := e.js.Stream(ctx, stream)
	if err != nil {
		return w, err
	}
	const stuckAfter = 30 * time.Second
	last, lastMove := uint64(0), time.Now()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		info, err := s.Info(ctx)
		if err != nil {
			return w, fmt.Errorf("reading %s: %w", stream, err)
		}
		now := time.Now()
		n := info.State.Msgs
		if n > 0 && w.first.IsZero() {
			w.first, w.firstN = now, n
			w.startup = now.Sub(since)
		}
		if n >= want {
			w.done, w.messages = now, n
			if el := w.done.Sub(w.first); el > 0 && n > w.firstN {
				w.rate = float64(n-w.firstN) / el.Seconds()
			} else {
				w.rate = float64(n) / now.Sub(since).Seconds()
			}
			return w, nil
		}
		if n != last {
			last, lastMove = n, now
		} else if now.Sub(lastMove) > stuckAfter {
			return w, fmt.Errorf("%s: %s stuck at %d of %d messages for %v", what, stream, n, want, stuckAfter)
		}
		if !w.first.IsZero() {
			el := now.Sub(w.first).Seconds()
			rate := 0.0
			if el > 0 {
				rate = float64(n-w.firstN) / el
			}
			e.prog.show("%s: %d/%d messages, %.0f msgs/s", what, n, want, rate)
		} else {
			e.prog.show("%s: waiting for the first message", what)
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return w, ctx.Err()
		}
	}
}

// mappers are in-process kvmapper replicas sharing one run.
type mappers struct {
	cancel context.CancelFunc
	g      *errgroup.Group
	ready  chan struct{} // closed when every replica has loaded its table
}

// startMappers starts n in-process replicas on names and returns once each has loaded its table.
func (e *env) startMappers(ctx context.Context, names Names, n int) (*mappers, error) {
	rctx, cancel := context.WithCancel(ctx)
	g, gctx := errgroup.WithContext(rctx)
	m := &mappers{cancel: cancel, g: g, ready: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Add(n)
	for i := range n {
		id := fmt.Sprintf("bench-%d-%d", e.runs, i+1)
		g.Go(func() error {
			var once sync.Once
			err := RunReplica(gctx, e.log, e.cfg.URL, id, names, func() { once.Do(wg.Done) })
			once.Do(wg.Done)
			if err != nil {
				return fmt.Errorf("replica %s: %w", id, err)
			}
			if gctx.Err() == nil {
				return fmt.Errorf("replica %s stopped on its own", id)
			}
			return nil
		})
	}
	go func() {
		wg.Wait()
		close(m.ready)
	}()
	select {
	case <-m.ready:
	case <-ctx.Done():
	}
	if gctx.Err() != nil {
		err := m.stop()
		if err == nil {
			err = ctx.Err()
		}
		return nil, err
	}
	return m, nil
}

// stop stops the replicas and waits for them.
func (m *mappers) stop() error {
	m.cancel()
	err := m.g.Wait()
	<-m.ready
	return err
}

// waitOwned waits until every partition has a lease in the control bucket of names: the
// replicas are consuming.
func (e *env) waitOwned(ctx context.Context, names Names) error {
	ctl, err := e.js.KeyValue(ctx, names.Control)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		owned := 0
		for p := range names.Partitions {
			if _, err := ctl.Get(ctx, wire.LeaseKey(p)); err == nil {
				owned++
			}
		}
		if owned == names.Partitions {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d partitions owned after 30s", owned, names.Partitions)
		}
		e.prog.show("waiting for the replicas to own every partition: %d/%d", owned, names.Partitions)
		t := time.NewTimer(20 * time.Millisecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
}

// ensure creates the streams and buckets of names as kvmapper's setup does.
func (e *env) ensure(ctx context.Context, names Names) error {
	_, err := setup.Ensure(ctx, e.js, setup.Config{Layout: e.lay, Names: names.Names, Replicas: names.StreamReplicas})
	return err
}

// deleteStream deletes a stream if it exists.
func (e *env) deleteStream(ctx context.Context, name string) error {
	if err := e.js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("deleting %s: %w", name, err)
	}
	return nil
}

// purgeIncoming empties INCOMING; its sequence numbers go on, so a fresh run starts after them.
func (e *env) purgeIncoming(ctx context.Context) error {
	for _, name := range e.incoming().IncomingStreams(e.cfg.Partitions) {
		s, err := e.js.Stream(ctx, name)
		if err != nil {
			return err
		}
		if err := s.Purge(ctx); err != nil {
			return err
		}
	}
	return nil
}

// cpuTime returns the user+system CPU time of process pid (0: this process) from /proc.
func cpuTime(pid int) time.Duration {
	path := "/proc/self/stat"
	if pid != 0 {
		path = "/proc/" + strconv.Itoa(pid) + "/stat"
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	// The command name, in parentheses, may hold spaces: fields count from after it.
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		s = s[i+1:]
	}
	f := strings.Fields(s)
	if len(f) < 13 {
		return 0
	}
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0
	}
	const ticks = 100 // USER_HZ on every Linux platform Go supports
	return time.Duration(ut+st) * time.Second / ticks
}

// cpuMeter measures the CPU time the servers and this process spend over a span.
type cpuMeter struct {
	pids           []int
	server, client time.Duration
}

func (e *env) cpuStart() cpuMeter {
	return cpuMeter{pids: e.cfg.ServerPIDs, server: serversCPU(e.cfg.ServerPIDs), client: cpuTime(0)}
}

// serversCPU is the CPU time of the processes pids together.
func serversCPU(pids []int) time.Duration {
	var d time.Duration
	for _, pid := range pids {
		d += cpuTime(pid)
	}
	return d
}

// stop returns the CPU seconds spent since start: the servers together (0 when unknown) and
// this process.
func (m cpuMeter) stop() (server, client Seconds) {
	if len(m.pids) > 0 {
		server = secs(serversCPU(m.pids) - m.server)
	}
	return server, secs(cpuTime(0) - m.client)
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// outSubject is where a device's messages go with the group the bench gave it.
func (e *env) outSubject(i int) string {
	return "outgoing." + e.groupOf[i] + "." + e.devices[i] + "." + event
}

// header of the naive mapper's publishes, like kvmapper's: a deterministic message id.
func msgID(seq uint64) nats.Header {
	return nats.Header{nats.MsgIdHdr: []string{incomingStream + ":" + strconv.FormatUint(seq, 10)}}
}
