package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/lanes"
	replica "github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// TestControlPlaneDoesNotQueueBehindTheLanes: a replica whose lanes write over a slow link (a
// proxy that carries 256 KiB/s from the replica to the server) and have a backlog to map keeps
// every lease, because its renewals, heartbeats and checkpoints go on a connection of their own
// (mapper.Config.Control, which `kvmapper run` dials). On the lanes' connection they would wait
// behind everything the lanes sent before them — a window of megabytes — and the 2 s lease of a
// one-server control bucket runs out: the "shared" case shows that starvation, so that the
// "own" case is known to face it.
func TestControlPlaneDoesNotQueueBehindTheLanes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		own  bool // the control plane on a connection of its own
	}{{"shared", false}, {"own", true}} {
		t.Run(tc.name, func(t *testing.T) {
			// A server and a slow link of its own per case: the link's pace, not the CPU, is
			// the scenario.
			t.Parallel()
			e := newEnv(t)
			devices := deviceNames("dev-", 64)
			for _, d := range devices {
				e.put(d, "g")
			}
			// The backlog: 4,000 messages of 2 KiB, 8 MiB to write, half a minute on the link.
			payload := []byte(strings.Repeat("x", 2<<10))
			pctx, pcancel := context.WithTimeout(context.Background(), time.Minute)
			var futs []jetstream.PubAckFuture
			for i := range 4000 {
				d := devices[i%len(devices)]
				fut, err := e.js.PublishAsync("incoming."+d+".evt", payload)
				if err != nil {
					t.Fatal(err)
				}
				if futs = append(futs, fut); len(futs) == 500 {
					settle(t, pctx, futs)
					futs = futs[:0]
				}
			}
			settle(t, pctx, futs)
			pcancel()

			link := newSlowLink(t, e.srv.Port(), 256<<10)
			nc, err := nats.Connect(link.url(), nats.MaxReconnects(-1), nats.ReconnectBufSize(-1))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			data, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			var control jetstream.JetStream
			if tc.own {
				_, control = e.srv.JetStream(t, nats.MaxReconnects(-1), nats.ReconnectBufSize(-1))
			}
			lay := layout(t)
			scfg := setup.Config{Layout: lay}
			scfg.Defaults()
			logs := &logBuf{}
			r, err := replica.New(context.Background(), data, replica.Config{
				ID: "r", Setup: scfg, Control: control,
				// A short drain: the shared case ends with its link full, and with the default
				// 10 s drain its lanes took longer than the ReleaseTimeout (drain + 10 s) to
				// return, were abandoned and ran on past the test (goleak saw one).
				Lanes:    lanes.Config{Layout: lay, DrainTimeout: time.Second},
				Election: election.Config{RenewInterval: 500 * time.Millisecond},
				Logger:   zerolog.New(logs).Level(zerolog.WarnLevel),
			})
			if err != nil {
				t.Fatalf("replica.New: %v", err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx, nil) }()
			t.Cleanup(func() {
				cancel()
				// The lanes' link may still be full: a lane whose publishes wait on it at the
				// link's pace can outlast the ReleaseTimeout and be abandoned (the goleak
				// finding of 2026-12-07, four lanes still draining at the end of a race run,
				// fits this case, though it named no test). Cut the link first: what the lanes
				// still send fails at once, and they stop.
				nc.Close()
				<-done
				abandoned(t, "r", logs)
			})
			// On the shared connection the claims themselves may starve behind the first
			// lanes' writes (a loaded machine saw 15 of 16 claimed in 30 s): that is the
			// starvation this case is to show.
			// A lease lost meanwhile shows the starvation at once: the shared case need not
			// wait out the 30 s.
			claimBy := time.Now().Add(30 * time.Second)
			var most int64 // the most bytes the lanes held in flight on the link
			for len(r.Owned()) != partitions && time.Now().Before(claimBy) {
				most = max(most, r.Stats().InFlightBytes)
				if !tc.own && strings.Contains(logs.String(), "partition lease lost") {
					t.Logf("with the control plane on the lanes' slow connection the replica lost a lease while it still claimed (%d of %d owned): its renewals starved", len(r.Owned()), partitions)
					return
				}
				tick := time.NewTimer(50 * time.Millisecond)
				<-tick.C
			}
			if n := len(r.Owned()); n != partitions {
				if tc.own {
					t.Fatalf("the replica owns %d partitions after 30 s, want %d", n, partitions)
				}
				t.Logf("with the control plane on the lanes' slow connection the replica claimed only %d of %d partitions in 30 s: its claims starved", n, partitions)
				return
			}
			before := leaseEpochs(t, e.js)
			// Three lease TTLs with the link full: the lanes hold megabytes in flight on it.
			deadline := time.Now().Add(3 * r.LeaseTTL())
			for time.Now().Before(deadline) {
				most = max(most, r.Stats().InFlightBytes)
				tick := time.NewTimer(50 * time.Millisecond)
				<-tick.C
			}
			after := leaseEpochs(t, e.js)
			var moved []string
			for p := range before {
				if after[p] != before[p] {
					moved = append(moved, fmt.Sprintf("%d: %s → %s", p, before[p], after[p]))
				}
			}
			lost := strings.Count(logs.String(), "partition lease lost")
			t.Logf("up to %d bytes in flight on the link; %d leases claimed again, %d lost in the log", most, len(moved), lost)
			// Megabytes in flight are what the own case must face, and what the shared case
			// must show starving its renewals, unless it already lost a lease (a CI run of
			// 2026-12-08 failed this check in the shared case: its lanes held 0.7 MB at most,
			// and whether a lease was lost is not in the record).
			if most < 1<<20 && (tc.own || len(moved) == 0 && lost == 0) {
				t.Fatalf("the lanes held at most %d bytes in flight on the slow link, want megabytes: the test proves nothing", most)
			}
			switch {
			case tc.own && (len(moved) > 0 || lost > 0):
				t.Errorf("with the control plane on its own connection, %d partitions were claimed again (%s) and %d leases lost", len(moved), strings.Join(moved, "; "), lost)
			case !tc.own && len(moved) == 0 && lost == 0:
				t.Errorf("with the control plane on the lanes' slow connection no lease was lost: the link did not starve the renewals, and the own case proves nothing")
			}
		})
	}
}

// leaseEpochs returns every partition's lease as owner@epoch, read from the control bucket.
func leaseEpochs(t *testing.T, js jetstream.JetStream) []string {
	t.Helper()
	out := make([]string, partitions)
	for p := range partitions {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		m, err := kvcas.Latest(ctx, js, subjects.DefaultNames.Control, wire.LeaseKey(p))
		cancel()
		if err != nil {
			t.Fatalf("reading lease %d: %v", p, err)
		}
		epoch := m.Header.Get("Kvmapper-Lease-Epoch")
		if epoch == "" {
			epoch = strconv.FormatUint(m.Sequence, 10)
		}
		out[p] = string(m.Data) + "@" + epoch
	}
	return out
}

// slowLink is a TCP proxy on loopback to a server whose client-to-server direction carries at
// most rate bytes a second: a slow network link. The pace is the scenario, not a
// synchronisation: time must pass for the bytes to go.
type slowLink struct {
	ln    net.Listener
	rate  int
	mu    sync.Mutex
	conns []net.Conn
	sent  atomic.Int64
}

func newSlowLink(t *testing.T, port, rate int) *slowLink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &slowLink{ln: ln, rate: rate}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
			if err != nil {
				c.Close()
				continue
			}
			l.mu.Lock()
			l.conns = append(l.conns, c, s)
			l.mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(c, s); c.Close() })
			wg.Go(func() { l.carry(s, c); s.Close() })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		l.mu.Lock()
		for _, c := range l.conns {
			c.Close()
		}
		l.mu.Unlock()
		wg.Wait()
	})
	return l
}

func (l *slowLink) url() string { return "nats://" + l.ln.Addr().String() }

// carry copies from src to dst at the link's rate, in chunks of a hundredth of a second.
func (l *slowLink) carry(dst, src net.Conn) {
	chunk := max(l.rate/100, 512)
	buf := make([]byte, chunk)
	next := time.Now()
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
			l.sent.Add(int64(n))
			next = next.Add(time.Duration(n) * time.Second / time.Duration(l.rate))
			if d := time.Until(next); d > 0 {
				time.Sleep(d) // the link's pace
			} else {
				next = time.Now()
			}
		}
		if err != nil {
			return
		}
	}
}
