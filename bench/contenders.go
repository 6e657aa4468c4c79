package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
	"golang.org/x/sync/errgroup"
)

// The contenders a user would write instead of kvmapper (issue 10). None of them keeps
// kvmapper's promises across a failover; they show what the same server does for a client that
// does not try.
const (
	// HandWritten is the careful mapper of an afternoon: one durable pull consumer on INCOMING
	// (one per partition stream in the streams layout), an async publish window of
	// handWindow with a Nats-Msg-Id, and each INCOMING message acknowledged after its PubAck.
	HandWritten ContenderName = "hand-written mapper"
	// RelayAsync is one unfiltered ordered consumer per INCOMING stream and async publishes
	// with a Nats-Msg-Id: kvmapper's reading and writing without its bookkeeping.
	RelayAsync ContenderName = "relay, async publish"
	// RelayCeiling is one unfiltered ordered consumer per INCOMING stream feeding one
	// fast-ingest batch publisher (jetstreamext.FastPublisher) into an allow_batched OUTGOING,
	// with a Nats-Msg-Id: the fastest durable write path nats-server 2.15 offers a client.
	RelayCeiling ContenderName = "relay ceiling, fast batches"
	// RelayAtomic is one unfiltered ordered consumer per INCOMING stream feeding
	// relayAtomicInFlight writers, each committing up to relayAtomicBatch messages at a time as
	// one atomic batch (jetstreamext.PublishMsgBatch, no flow-control ack) into an
	// allow_atomic OUTGOING, with a Nats-Msg-Id: how a user writes a replicated stream in
	// atomic batches, as kvmapper does on a cluster, without its order, fence or bookkeeping.
	RelayAtomic ContenderName = "relay, atomic batches"
)

// Keys are the short names [Config.Contenders] and the bench's --contenders flag take, in the
// order the throughput run runs them.
var Keys = []struct {
	Key  string
	Name ContenderName
}{
	{"copy", Copy},
	{"transform", Transform},
	{"kvmapper", KVMapper},
	{"no-provenance", KVMapperBare},
	{"hand-written", HandWritten},
	{"relay-async", RelayAsync},
	{"relay-ceiling", RelayCeiling},
	{"relay-atomic", RelayAtomic},
	{"naive", Naive},
}

// ContenderByKey returns the contender a short key names, and whether there is one.
func ContenderByKey(key string) (ContenderName, bool) {
	for _, k := range Keys {
		if k.Key == key {
			return k.Name, true
		}
	}
	return "", false
}

const (
	// handWindow is the hand-written mapper's async publish window.
	handWindow = 1000
	// relayWindow is the async relay's window: kvmapper's default MaxInFlight.
	relayWindow = 4096
	// relayFlow and relayAcks let a fast batch have relayFlow × relayAcks messages
	// unacknowledged, about kvmapper's window; relayFlow is the most the server acknowledges at
	// once. relayBatch messages make one batch.
	relayFlow, relayAcks = 500, 8
	relayBatch           = 100_000
	// relayAtomicBatch and relayAtomicInFlight shape the atomic relay's batches: up to 256
	// messages each, 8 committing at once.
	relayAtomicBatch, relayAtomicInFlight = 256, 8
)

// mapOf returns device → group for the bench's devices.
func (e *env) mapOf() map[string]string {
	group := make(map[string]string, len(e.devices))
	for i, d := range e.devices {
		group[d] = e.groupOf[i]
	}
	return group
}

// outMsg maps a message stored as incoming.<p>.<device>.<event> in stream at seq, as a user
// would: split the subject, look the group up, set a deterministic Nats-Msg-Id.
func outMsg(group map[string]string, stream, subject string, seq uint64, data []byte) (*nats.Msg, error) {
	rest, ok := strings.CutPrefix(subject, "incoming.")
	_, rest, ok2 := strings.Cut(rest, ".")
	device, ev, ok3 := strings.Cut(rest, ".")
	g, ok4 := group[device]
	if !ok || !ok2 || !ok3 || !ok4 {
		return nil, fmt.Errorf("cannot map %q", subject)
	}
	return &nats.Msg{
		Subject: "outgoing." + g + "." + device + "." + ev,
		Header:  nats.Header{nats.MsgIdHdr: []string{stream + ":" + strconv.FormatUint(seq, 10)}},
		Data:    data,
	}, nil
}

// rival runs one contender that maps INCOMING into a stream of its own with a connection of its
// own: create makes the target stream, run maps until its context ends. It is timed from the
// start of run until the target holds every INCOMING message.
func (e *env) rival(ctx context.Context, name ContenderName, target string, create jetstream.StreamConfig,
	run func(ctx context.Context, nc *nats.Conn) error) (Contender, error) {
	msgs, _, err := e.incomingState(ctx)
	if err != nil {
		return Contender{}, err
	}
	nc, err := nats.Connect(e.cfg.URL, nats.Name("kvmapper bench "+string(name)))
	if err != nil {
		return Contender{}, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return Contender{}, err
	}
	create.Name, create.Subjects, create.Storage, create.Duplicates = target, []string{e.lay.OutStreamSubject()}, jetstream.FileStorage, 2*time.Minute
	create.Replicas = e.cfg.StreamReplicas
	if _, err := js.CreateStream(ctx, create); err != nil {
		return Contender{}, fmt.Errorf("creating %s: %w", target, err)
	}
	if err := e.profile(name, true); err != nil {
		return Contender{}, err
	}
	cpu := e.cpuStart()
	start := time.Now()
	rctx, stop := context.WithCancel(ctx)
	// A contender that fails ends the wait for its messages at once.
	wctx, failed := context.WithCancelCause(ctx)
	defer failed(nil)
	errc := make(chan error, 1)
	go func() {
		err := run(rctx, nc)
		if err != nil && rctx.Err() == nil {
			failed(err)
		}
		errc <- err
	}()
	w, err := e.waitCount(wctx, target, msgs, start, string(name))
	server, client := cpu.stop()
	if perr := e.profile(name, false); err == nil {
		err = perr
	}
	stop()
	if rerr := <-errc; rerr != nil && !errors.Is(rerr, context.Canceled) && (err == nil || errors.Is(err, context.Canceled)) {
		err = rerr
	}
	if err != nil {
		return Contender{}, err
	}
	c, err := e.contender(ctx, name, target, w)
	if err != nil {
		return c, err
	}
	c.ServerCPU, c.ClientCPU = server, client
	return c, e.deleteStream(ctx, target)
}

// profile starts or stops the profiles around the contender cfg.Profile names.
func (e *env) profile(name ContenderName, start bool) error {
	if name != e.cfg.Profile {
		return nil
	}
	return e.profiles(start)
}

// handWritten is [HandWritten].
func (e *env) handWritten(ctx context.Context) (Contender, error) {
	group := e.mapOf()
	streams := e.incoming().IncomingStreams(e.cfg.Partitions)
	return e.rival(ctx, HandWritten, "BENCH_OUT_HAND", jetstream.StreamConfig{}, func(ctx context.Context, nc *nats.Conn) error {
		js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(handWindow))
		if err != nil {
			return err
		}
		g, gctx := errgroup.WithContext(ctx)
		for _, in := range streams {
			cons, err := js.CreateOrUpdateConsumer(ctx, in, jetstream.ConsumerConfig{
				Durable: "bench-hand", AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 2 * handWindow,
			})
			if err != nil {
				return err
			}
			g.Go(func() error { return handLoop(gctx, js, cons, in, group) })
		}
		err = g.Wait()
		// The durable consumers outlive the run: remove them, on a context of their own.
		dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, in := range streams {
			if derr := js.DeleteConsumer(dctx, in, "bench-hand"); derr != nil && err == nil {
				err = derr
			}
		}
		return err
	})
}

// pending is a hand-written publish waiting for its PubAck before its INCOMING message is
// acknowledged.
type pending struct {
	f   jetstream.PubAckFuture
	in  jetstream.Msg
	out *nats.Msg
}

// handLoop maps one INCOMING stream: the reader publishes, a second goroutine waits for each
// PubAck in order, resends what failed, and acknowledges INCOMING.
func handLoop(ctx context.Context, js jetstream.JetStream, cons jetstream.Consumer, stream string, group map[string]string) error {
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	defer it.Stop()
	stopIt := context.AfterFunc(ctx, it.Stop)
	defer stopIt()
	acks := make(chan pending, handWindow)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		for p := range acks {
			select {
			case <-p.f.Ok():
			case err := <-p.f.Err():
				// Resend once, synchronously: the window would otherwise hold the failure.
				if _, err2 := js.PublishMsg(gctx, p.out); err2 != nil {
					return fmt.Errorf("publish failed (%v), and again: %w", err, err2)
				}
			case <-gctx.Done():
				return gctx.Err()
			}
			if err := p.in.Ack(); err != nil {
				return err
			}
		}
		return nil
	})
	g.Go(func() error {
		defer close(acks)
		for {
			m, err := it.Next()
			if err != nil {
				return err
			}
			md, err := m.Metadata()
			if err != nil {
				return err
			}
			out, err := outMsg(group, stream, m.Subject(), md.Sequence.Stream, m.Data())
			if err != nil {
				return err
			}
			f, err := js.PublishMsgAsync(out, stall...)
			if err != nil {
				return err
			}
			select {
			case acks <- pending{f: f, in: m, out: out}:
			case <-gctx.Done():
				return gctx.Err()
			}
		}
	})
	err = g.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// relay reads every INCOMING stream with one unfiltered ordered consumer each and hands each
// message, mapped, to write, from the consumers' own goroutines; it returns when ctx ends or a
// consumer or write fails.
func (e *env) relay(ctx context.Context, js jetstream.JetStream, write func(*nats.Msg) error) error {
	group := e.mapOf()
	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var stops []jetstream.ConsumeContext
	defer func() {
		for _, s := range stops {
			s.Stop()
		}
		for _, s := range stops {
			<-s.Closed()
		}
	}()
	for _, in := range e.incoming().IncomingStreams(e.cfg.Partitions) {
		cons, err := js.OrderedConsumer(ctx, in, jetstream.OrderedConsumerConfig{})
		if err != nil {
			return err
		}
		cc, err := cons.Consume(func(m jetstream.Msg) {
			if rctx.Err() != nil {
				return
			}
			seq, err := streamSeq(m)
			var out *nats.Msg
			if err == nil {
				out, err = outMsg(group, in, m.Subject(), seq, m.Data())
			}
			if err == nil {
				err = write(out)
			}
			if err != nil {
				cancel(err)
			}
		}, jetstream.ConsumeErrHandler(func(jetstream.ConsumeContext, error) {
			// The ordered consumer resets itself; a relay that stops moving fails the run
			// in waitCount.
		}))
		if err != nil {
			return err
		}
		stops = append(stops, cc)
	}
	<-rctx.Done()
	return context.Cause(rctx)
}

// streamSeq reads a consumed message's stream sequence from its reply subject, as cheaply as a
// user who cares would.
func streamSeq(m jetstream.Msg) (uint64, error) {
	md, err := m.Metadata()
	if err != nil {
		return 0, err
	}
	return md.Sequence.Stream, nil
}

// relayAsync is [RelayAsync].
func (e *env) relayAsync(ctx context.Context) (Contender, error) {
	return e.rival(ctx, RelayAsync, "BENCH_OUT_RELAY", jetstream.StreamConfig{}, func(ctx context.Context, nc *nats.Conn) error {
		js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(relayWindow))
		if err != nil {
			return err
		}
		return e.relay(ctx, js, asyncWrite(js))
	})
}

// asyncWrite is [RelayAsync]'s write: an async publish, waiting while the window is full.
func asyncWrite(js jetstream.JetStream) func(*nats.Msg) error {
	return func(m *nats.Msg) error {
		_, err := js.PublishMsgAsync(m, stall...)
		return err
	}
}

// relayCeiling is [RelayCeiling]: the consumers hand their messages to one writer goroutine,
// because a FastPublisher is not safe for concurrent use and one batch is acknowledged every
// 500 messages, where N concurrent batches are acknowledged every 500/N.
func (e *env) relayCeiling(ctx context.Context) (Contender, error) {
	return e.rival(ctx, RelayCeiling, "BENCH_OUT_CEILING", jetstream.StreamConfig{AllowBatchPublish: true}, func(ctx context.Context, nc *nats.Conn) error {
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		return e.relayToWriters(ctx, js, 1, batchWriter)
	})
}

// batchWriter publishes msgs in fast batches of relayBatch messages until ctx ends or a batch
// fails.
func batchWriter(ctx context.Context, js jetstream.JetStream, msgs <-chan *nats.Msg) error {
	var mu sync.Mutex
	var asyncErr error
	newBatch := func() (jetstreamext.FastPublisher, error) {
		return jetstreamext.NewFastPublisher(js,
			jetstreamext.FastPublishFlowControl{Flow: relayFlow, MaxOutstandingAcks: relayAcks, AckTimeout: 10 * time.Second},
			jetstreamext.WithFastPublisherErrorHandler(func(err error) {
				mu.Lock()
				defer mu.Unlock()
				if asyncErr == nil {
					asyncErr = err
				}
			}))
	}
	fp, err := newBatch()
	if err != nil {
		return err
	}
	n := 0
	defer func() {
		if n > 0 {
			cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, _ = fp.Close(cctx)
		}
	}()
	for {
		var m *nats.Msg
		select {
		case m = <-msgs:
		case <-ctx.Done():
			return ctx.Err()
		}
		if n+1 < relayBatch {
			_, err = fp.AddMsg(m)
			n++
		} else {
			_, err = fp.CommitMsg(ctx, m)
			n = 0
			if err == nil {
				fp, err = newBatch()
			}
		}
		if err == nil {
			mu.Lock()
			err = asyncErr
			mu.Unlock()
		}
		if err != nil {
			return fmt.Errorf("fast batch: %w", err)
		}
	}
}

// relayToWriters runs the relay's readers, handing every mapped message through a channel of
// relayWindow to n writers, until ctx ends or a reader or writer fails.
func (e *env) relayToWriters(ctx context.Context, js jetstream.JetStream, n int,
	writer func(context.Context, jetstream.JetStream, <-chan *nats.Msg) error) error {
	msgs := make(chan *nats.Msg, relayWindow)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		return e.relay(gctx, js, func(m *nats.Msg) error {
			select {
			case msgs <- m:
				return nil
			case <-gctx.Done():
				return gctx.Err()
			}
		})
	})
	for range n {
		g.Go(func() error { return writer(gctx, js, msgs) })
	}
	return g.Wait()
}

// relayAtomic is [RelayAtomic]: the consumers hand their messages to relayAtomicInFlight
// writers; each takes what is waiting, up to relayAtomicBatch messages, and commits it as one
// atomic batch, waiting for its answer before it takes more.
func (e *env) relayAtomic(ctx context.Context) (Contender, error) {
	return e.rival(ctx, RelayAtomic, "BENCH_OUT_ATOMIC", jetstream.StreamConfig{AllowAtomicPublish: true}, func(ctx context.Context, nc *nats.Conn) error {
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		return e.relayToWriters(ctx, js, relayAtomicInFlight, atomicWriter)
	})
}

// atomicWriter commits what msgs holds in atomic batches of up to relayAtomicBatch messages,
// one at a time, until ctx ends or a batch fails.
func atomicWriter(ctx context.Context, js jetstream.JetStream, msgs <-chan *nats.Msg) error {
	batch := make([]*nats.Msg, 0, relayAtomicBatch)
	noAck := jetstreamext.BatchFlowControl{AckTimeout: 10 * time.Second}
	for {
		batch = batch[:0]
		select {
		case m := <-msgs:
			batch = append(batch, m)
		case <-ctx.Done():
			return ctx.Err()
		}
	fill:
		for len(batch) < relayAtomicBatch {
			select {
			case m := <-msgs:
				batch = append(batch, m)
			default:
				break fill
			}
		}
		if _, err := jetstreamext.PublishMsgBatch(ctx, js, batch, noAck); err != nil {
			return fmt.Errorf("atomic batch of %d: %w", len(batch), err)
		}
	}
}

// ContenderKeys are the keys of [Keys], in its order.
func ContenderKeys() []string {
	var keys []string
	for _, k := range Keys {
		keys = append(keys, k.Key)
	}
	return keys
}
