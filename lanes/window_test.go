package lanes_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// wireTap records, from outside the pool, every distinct publish a subscription sees: the first
// copy of each Nats-Msg-Id and its size on the wire.
type wireTap struct {
	mu    sync.Mutex
	sizes map[string]int
	bytes int
}

// swallow subscribes to subject on a connection of its own and never answers: to the lanes,
// every publish there stays in flight, as if the stream took it and never acknowledged.
func (f *fixture) swallow(subject string) *wireTap {
	f.t.Helper()
	w := &wireTap{sizes: map[string]int{}}
	nc := f.srv.Connect(f.t)
	if _, err := nc.Subscribe(subject, func(m *nats.Msg) {
		id := m.Header.Get(nats.MsgIdHdr)
		w.mu.Lock()
		if _, ok := w.sizes[id]; !ok {
			w.sizes[id] = m.Size()
			w.bytes += m.Size()
		}
		w.mu.Unlock()
	}); err != nil {
		f.t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		f.t.Fatal(err)
	}
	return w
}

func (w *wireTap) seen() (msgs, bytes int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.sizes), w.bytes
}

// I5 seen from outside: with no acknowledgement ever, every distinct message a lane sent is
// still in flight, so what the wire carries is the in-flight bound itself.
func TestInFlightBoundOnTheWire(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		cfg     lanes.Config
		payload int
	}{
		// 64 messages bind long before 64 MiB.
		"messages": {cfg: lanes.Config{MaxInFlight: 64}, payload: 16},
		// 128 KiB bind long before 4096 messages of about 1.3 KiB each. Each message is below
		// the guarantee of a partition (128 KiB / 64), so not even the first one of a lane may
		// go past the bound.
		"bytes": {cfg: lanes.Config{MaxInFlightBytes: 128 << 10}, payload: 1 << 10},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			if err := f.js.DeleteStream(context.Background(), "OUTGOING"); err != nil {
				t.Fatal(err)
			}
			w := f.swallow("outgoing.>")
			devs := devices(64)
			for _, d := range devs {
				f.groups.set(d, "g")
			}
			f.publish(devs, 20, pad(tc.payload))
			tc.cfg.PublishTimeout, tc.cfg.DrainTimeout = time.Second, 500*time.Millisecond
			pool, _ := f.run(tc.cfg, nil)
			// The first timeouts mean every lane has waited a second for room: the window is
			// as full as it gets, and stays so, as nothing is ever acknowledged.
			natstest.Eventually(t, 20*time.Second, func() error {
				if pool.Stats().Failures == 0 {
					return errors.New("no publish timed out yet")
				}
				return nil
			})
			msgs, bytes := w.seen()
			st := pool.Stats()
			t.Logf("on the wire: %d messages, %d bytes; Stats() = %+v", msgs, bytes, st)
			maxMsgs, maxBytes := 4096, 64<<20
			if tc.cfg.MaxInFlight != 0 {
				maxMsgs = tc.cfg.MaxInFlight
			}
			if tc.cfg.MaxInFlightBytes != 0 {
				maxBytes = int(tc.cfg.MaxInFlightBytes)
			}
			if msgs > maxMsgs || bytes > maxBytes {
				t.Errorf("%d messages of %d bytes in flight on the wire, want at most %d and %d bytes", msgs, bytes, maxMsgs, maxBytes)
			}
			// And the bound is what held them back, not a lack of messages.
			if msgs < maxMsgs && bytes < maxBytes*3/4 {
				t.Errorf("%d messages of %d bytes in flight on the wire: neither bound (%d, %d bytes) was reached", msgs, bytes, maxMsgs, maxBytes)
			}
			if st.InFlight != msgs || st.InFlightBytes < int64(bytes) {
				t.Errorf("Stats() = %+v, want InFlight %d and InFlightBytes at least %d, as on the wire", st, msgs, bytes)
			}
		})
	}
}

// A partition whose publishes are never answered keeps what it holds of the window through
// every retry; it must not stall the others. Its devices map to a group whose subject only a
// subscriber that never answers listens to.
func TestStuckPartitionDoesNotStallOthers(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		cfg        lanes.Config
		stuckPad   int // header bytes on the stuck partition's messages
		othersPad  int // and on the others'
		checkShare bool
	}{
		"messages": {cfg: lanes.Config{MaxInFlight: 256}, checkShare: true},
		// The stuck lane holds all the bytes it may; the others' messages are larger than a
		// partition's guarantee (640 KiB / 64 = 10 KiB), and must still go through.
		"bytes": {cfg: lanes.Config{MaxInFlightBytes: 640 << 10}, stuckPad: 1 << 10, othersPad: 12 << 10},
	} {
		t.Run(name, func(t *testing.T) {
			eachLayout(t, func(t *testing.T, f *fixture) {
				ctx := context.Background()
				s, err := f.js.Stream(ctx, "OUTGOING")
				if err != nil {
					t.Fatal(err)
				}
				cfg := s.CachedInfo().Config
				cfg.Subjects = []string{"outgoing.g.>"}
				if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
					t.Fatal(err)
				}
				f.swallow("outgoing.stuck.>")
				stuckP := subjects.Partition("dev-000", 16)
				var stuck, others []string
				for _, d := range devices(200) {
					if subjects.Partition(d, 16) == stuckP {
						stuck = append(stuck, d)
						f.groups.set(d, "stuck")
					} else {
						others = append(others, d)
						f.groups.set(d, "g")
					}
				}
				tc.cfg.PublishTimeout, tc.cfg.DrainTimeout = 500*time.Millisecond, 500*time.Millisecond
				pool, _ := f.run(tc.cfg, nil)
				// The stuck partition first, alone: it takes what it may, and its publishes time out.
				f.publish(stuck, 100, pad(tc.stuckPad))
				natstest.Eventually(t, 20*time.Second, func() error {
					if pool.Stats().Failures == 0 {
						return errors.New("the stuck partition's publishes have not timed out yet")
					}
					return nil
				})
				held := pool.Partitions()[stuckP].InFlight
				t.Logf("the stuck lane holds %d messages; Stats() = %+v", held, pool.Stats())
				// Then the others: all their messages go through, in order, while it holds on.
				const n = 10
				f.publish(others, n, pad(tc.othersPad))
				f.waitOrDump(pool, "OUTGOING", uint64(n*len(others)), 60*time.Second)
				checkOrder(t, f.read("OUTGOING", n*len(others)), others, n, func(d string) string { return "outgoing.g." + d + ".evt" })
				if now := pool.Partitions()[stuckP].InFlight; now > held {
					t.Errorf("the stuck lane holds %d in flight, more than the %d it held alone", now, held)
				}
				// Alone, it got more than an even share (window/16), but not the others' guarantees.
				if w := tc.cfg.MaxInFlight; tc.checkShare && (held <= w/2 || held >= w) {
					t.Errorf("the stuck lane held %d of %d in flight, want more than half and less than all", held, w)
				}
			})
		})
	}
}

// pad returns a header of n bytes, or nil.
func pad(n int) nats.Header {
	if n == 0 {
		return nil
	}
	return nats.Header{"X-Pad": []string{strings.Repeat("p", n)}}
}

// A message larger than PullMaxBytes still reaches the lane: a pull request it does not fit in
// would stall the partition, so the bound is raised to the connection's maximum payload.
func TestMessageLargerThanPullMaxBytes(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	devs := devices(20)
	for _, d := range devs {
		f.groups.set(d, "g")
	}
	f.padding = make([]byte, 100<<10)
	f.publish(devs, 10, nil)
	pool, _ := f.run(lanes.Config{PullMaxBytes: 64 << 10}, nil)
	f.waitOrDump(pool, "OUTGOING", 200, 60*time.Second)
	checkOrder(t, f.read("OUTGOING", 200), devs, 10, func(d string) string { return "outgoing.g." + d + ".evt" })
}
