package direct_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const partitions = 16

// groups is a device → group table for tests, standing in for package kv: each change bumps
// its revision, as a KV put does.
type groups struct {
	mu     sync.RWMutex
	m      map[string]string
	rev    uint64
	schema *subjects.Schema // nil: subjects.GroupSchema
}

func newGroups() *groups { return &groups{m: map[string]string{}} }

func (g *groups) set(device, group string) {
	g.mu.Lock()
	g.m[device] = group
	g.rev++
	g.mu.Unlock()
}

func (g *groups) revision() uint64 {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.rev
}

func (g *groups) lookup(device string) subjects.Mapping {
	g.mu.RLock()
	v, ok := g.m[device]
	rev, sc := g.rev, g.schema
	g.mu.RUnlock()
	if !ok {
		return subjects.Unmappable(wire.ReasonNoMapping, "", "", 0)
	}
	return kv.DecodeEntry(sc, []byte(v), rev).Mapping()
}

// fixture is a server set up for direct mode in one receive mode, and a device's connection.
type fixture struct {
	t       testing.TB
	srv     *natstest.Server
	lay     *subjects.Layout
	receive wire.Receive
	dev     *nats.Conn // what devices publish on
	js      jetstream.JetStream
	groups  *groups
}

func newFixture(t testing.TB, receive wire.Receive, mods ...func(ctx context.Context, js jetstream.JetStream)) *fixture {
	t.Helper()
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", partitions)
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.Start(t)
	if receive == wire.ReceiveMapping {
		// What `kvmapper run --embedded --mode direct` gives its server, and the mappings block
		// of setup.MappingConfig gives any other.
		if err := srv.GlobalAccount().AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
			t.Fatal(err)
		}
	}
	f := &fixture{t: t, srv: srv, lay: lay, receive: receive, groups: newGroups()}
	f.dev, f.js = srv.JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, mod := range mods {
		mod(ctx, f.js)
	}
	if _, err := setup.Ensure(ctx, f.js, setup.Config{Layout: lay, Mode: wire.ModeDirect, Receive: wire.Receive(receive)}); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	return f
}

// eachReceive runs test once per receive mode, each on a server of its own.
func eachReceive(t *testing.T, test func(t *testing.T, f *fixture)) {
	t.Helper()
	for _, r := range []wire.Receive{wire.ReceiveMapping, wire.ReceiveAll} {
		t.Run(string(r), func(t *testing.T) { test(t, newFixture(t, r)) })
	}
}

// pool returns a pool on a connection of its own, closed at the end of the test.
func (f *fixture) pool(replica string, lookup direct.LookupFunc, mod func(*direct.Config)) *direct.Pool {
	f.t.Helper()
	return f.poolOn(f.srv.Connect(f.t, nats.ReconnectBufSize(-1)), replica, lookup, mod)
}

// poolOn returns a pool on nc, closed at the end of the test.
func (f *fixture) poolOn(nc *nats.Conn, replica string, lookup direct.LookupFunc, mod func(*direct.Config)) *direct.Pool {
	f.t.Helper()
	cfg := direct.Config{Layout: f.lay, Receive: f.receive, Replica: replica, HandoffTimeout: 5 * time.Second}
	if mod != nil {
		mod(&cfg)
	}
	if lookup == nil {
		lookup = f.groups.lookup
	}
	p, err := direct.New(nc, lookup, cfg)
	if err != nil {
		f.t.Fatalf("direct.New: %v", err)
	}
	f.t.Cleanup(p.Close)
	return p
}

// running is one Run of a partition.
type running struct {
	cancel context.CancelCauseFunc
	done   chan error
}

// run starts p.Run(a) and waits until the partition serves.
func (f *fixture) run(p *direct.Pool, a direct.Assignment) *running {
	f.t.Helper()
	r := f.start(p, a)
	r.waitServed(f.t, p, a, 10*time.Second)
	return r
}

// start starts p.Run(a).
func (f *fixture) start(p *direct.Pool, a direct.Assignment) *running {
	f.t.Helper()
	ctx, cancel := context.WithCancelCause(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- p.Run(ctx, a) }()
	// At the end of the test the partition stops at once, as with a lost lease: a release would
	// wait HandoffTimeout for a next owner.
	f.t.Cleanup(func() { r.cancel(direct.ErrFenced); <-r.done })
	return r
}

// waitServed waits up to timeout until p serves a.
func (r *running) waitServed(t testing.TB, p *direct.Pool, a direct.Assignment, timeout time.Duration) {
	t.Helper()
	natstest.Eventually(t, timeout, func() error {
		for _, s := range p.Partitions() {
			if s.Partition == a.Partition && s.Epoch == a.Epoch {
				return nil
			}
		}
		select {
		case err := <-r.done:
			r.done <- err
			return fmt.Errorf("Run(%d) returned %v before serving", a.Partition, err)
		default:
		}
		return fmt.Errorf("partition %d epoch %d not served yet", a.Partition, a.Epoch)
	})
}

// release ends the Run with a release (not a fence) and waits for it to return.
func (r *running) release(t testing.TB) {
	t.Helper()
	r.cancel(errors.New("released"))
	select {
	case err := <-r.done:
		r.done <- err
		if err != nil {
			t.Fatalf("Run() = %v after a release, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10s of a release")
	}
}

// runAll serves every partition with p, under epoch.
func (f *fixture) runAll(p *direct.Pool, epoch uint64) []*running {
	f.t.Helper()
	out := make([]*running, partitions)
	for part := range partitions {
		out[part] = f.run(p, direct.Assignment{Partition: part, Epoch: epoch})
	}
	return out
}

// devicesOf returns n device ids of partition part.
func devicesOf(part, n int) []string {
	var out []string
	for i := 0; len(out) < n; i++ {
		d := fmt.Sprintf("dev-%d", i)
		if subjects.Partition(d, partitions) == part {
			out = append(out, d)
		}
	}
	return out
}

// stream returns every message stream holds.
func (f *fixture) stream(name string) []jetstream.Msg {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, name)
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	n := int(info.State.Msgs)
	var out []jetstream.Msg
	if n == 0 {
		return out
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		f.t.Fatal(err)
	}
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

func subjectsPartition(dev string) int { return subjects.Partition(dev, partitions) }
