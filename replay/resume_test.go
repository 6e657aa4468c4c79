package replay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/replay"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// progressRecord is the part of a replay's progress record the tests look at.
type progressRecord struct {
	Sources []struct {
		First, Last, Done uint64
	} `json:"sources"`
	Complete bool `json:"complete"`
}

// recordWatch collects every value the control bucket's replay records take.
type recordWatch struct {
	mu     sync.Mutex
	values [][]byte
}

func (f *fixture) watchRecords() *recordWatch {
	f.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w, err := f.ctl.Watch(ctx, "replay.*", jetstream.UpdatesOnly())
	if err != nil {
		f.t.Fatal(err)
	}
	rw := &recordWatch{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for e := range w.Updates() {
			if e != nil && e.Operation() == jetstream.KeyValuePut {
				rw.mu.Lock()
				rw.values = append(rw.values, e.Value())
				rw.mu.Unlock()
			}
		}
	}()
	f.t.Cleanup(func() {
		cancel()
		<-done
	})
	return rw
}

// pick returns a recorded value whose single source is done between lo and hi. The watch
// delivers after the run has returned, so it first waits for the run's complete record; the
// records' spacing depends on how fast the machine saves, so on failure it lists what it saw.
func (rw *recordWatch) pick(t *testing.T, lo, hi uint64) []byte {
	t.Helper()
	var records []progressRecord
	var values [][]byte
	natstest.Eventually(t, 10*time.Second, func() error {
		rw.mu.Lock()
		values = slices.Clone(rw.values)
		rw.mu.Unlock()
		records = make([]progressRecord, len(values))
		for i, v := range values {
			if err := json.Unmarshal(v, &records[i]); err != nil {
				t.Fatal(err)
			}
		}
		if !slices.ContainsFunc(records, func(r progressRecord) bool { return r.Complete }) {
			return fmt.Errorf("the run's complete record is not among the %d seen", len(values))
		}
		return nil
	})
	var dones []uint64
	for i, r := range records {
		if len(r.Sources) != 1 || r.Complete {
			continue
		}
		if d := r.Sources[0].Done; d >= lo && d <= hi {
			return values[i]
		}
		dones = append(dones, r.Sources[0].Done)
	}
	t.Fatalf("no progress record done between %d and %d; the records were done at %v", lo, hi, dones)
	return nil
}

// createReplayStream makes REPLAY with a duplicate window too short to recognise anything sent
// again: only the replay's own bookkeeping can keep it from storing a message twice.
func (f *fixture) createReplayStream(mods ...func(*jetstream.StreamConfig)) {
	f.t.Helper()
	cfg := jetstream.StreamConfig{Name: "REPLAY", Subjects: []string{"replay.>", "replay-unmapped.>"}, Duplicates: 100 * time.Millisecond} // the least the server allows
	for _, m := range mods {
		m(&cfg)
	}
	if _, err := f.js.CreateStream(context.Background(), cfg); err != nil {
		f.t.Fatal(err)
	}
}

// A replay that died after writing its progress, with more stored than the progress says, is
// resumed without storing anything twice, after the target's duplicate window; and a resumed run
// stopped before it passed what the dead one had stored leaves the next run able to find it.
func TestResumeAfterACrashStoresNothingTwice(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	devs := devices("d", 8)
	for _, d := range devs {
		f.put(d, "g")
	}
	f.publish(devs, 200) // sequences 1..1600
	f.createReplayStream()
	records := f.watchRecords()
	cfg := f.config()
	cfg.Create, cfg.FromTime, cfg.FromSeq = false, time.Time{}, 1
	cfg.SaveInterval, cfg.MaxRate = 5*time.Millisecond, 8000
	first := f.mustRun(cfg)
	if first.Mapped != 1600 {
		t.Fatalf("first run mapped %d, want 1600", first.Mapped)
	}
	key := wire.ReplayKey(first.ID)
	ctx := context.Background()
	// Back to a record written early on: as if the process had been killed just after it, with
	// everything up to 1600 already stored.
	if _, err := f.ctl.Put(ctx, key, records.pick(t, 100, 900)); err != nil {
		t.Fatal(err)
	}

	// The next run goes slowly through what is stored already, and is stopped half-way.
	second, stop := context.WithCancel(ctx)
	defer stop()
	cfg.MaxRate, cfg.ReportInterval = 2000, 10*time.Millisecond
	cfg.Progress = func(p replay.Progress) {
		if p.Done >= 1000 {
			stop()
		}
	}
	r, err := replay.New(f.js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(second); err != nil {
		t.Fatalf("second run: %v", err)
	}
	s2 := r.Summary()
	if s2.Complete || !s2.Resumed || s2.AlreadyStored == 0 || s2.Mapped != 0 {
		t.Fatalf("second run: complete %v, resumed %v, already stored %d, mapped %d; want false, true, some, 0",
			s2.Complete, s2.Resumed, s2.AlreadyStored, s2.Mapped)
	}

	cfg.Progress, cfg.MaxRate = nil, 0
	third := f.mustRun(cfg)
	if !third.Resumed || third.AlreadyStored == 0 || third.Mapped != 0 {
		t.Errorf("third run: resumed %v, already stored %d, mapped %d; want true, some, 0", third.Resumed, third.AlreadyStored, third.Mapped)
	}
	msgs := f.read("REPLAY")
	perDevice(t, msgs)
	if len(msgs) != 1600 {
		t.Errorf("REPLAY holds %d messages, want 1600, each once", len(msgs))
	}
}

// Replays of different ranges run at once into one stream; a second process running the same
// replay as a first is stopped by the progress record, and nothing is stored twice.
func TestReplaysAtOnce(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	devs := devices("d", 4)
	for _, d := range devs {
		f.put(d, "g")
	}
	f.publish(devs, 250) // 1..1000
	f.createReplayStream(func(c *jetstream.StreamConfig) { c.Duplicates = time.Minute })
	ranges := [][2]uint64{{1, 400}, {401, 1000}}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	sums := make([]replay.Summary, 2)
	for i, rg := range ranges {
		cfg := f.config()
		cfg.Create, cfg.FromTime, cfg.FromSeq, cfg.ToSeq = false, time.Time{}, rg[0], rg[1]
		wg.Go(func() { sums[i], errs[i] = f.run(cfg) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil || !sums[i].Complete || sums[i].Mapped != ranges[i][1]-ranges[i][0]+1 {
			t.Fatalf("replay of %v: %v, complete %v, mapped %d", ranges[i], err, sums[i].Complete, sums[i].Mapped)
		}
	}
	if sums[0].ID == sums[1].ID {
		t.Fatalf("two ranges share the id %s", sums[0].ID)
	}
	seen := map[string]bool{}
	for _, m := range f.read("REPLAY") {
		id := seqOf(t, m)
		if seen[id] {
			t.Fatalf("%s stored twice", id)
		}
		seen[id] = true
	}
	if len(seen) != 1000 {
		t.Fatalf("REPLAY holds %d messages, want 1000", len(seen))
	}

	// The same replay twice at once: the second starts once the first has claimed the id.
	cfg := f.config()
	cfg.Create, cfg.Into = true, "TWICE"
	cfg.Layout = f.layout("twice.{group}.{device}.{event}", "twice-unmapped.{device}.{event}")
	cfg.MaxRate, cfg.ReportInterval = 2000, 10*time.Millisecond
	started := make(chan struct{})
	var once sync.Once
	cfg.Progress = func(p replay.Progress) {
		if p.Done > 0 {
			once.Do(func() { close(started) })
		}
	}
	var firstErr error
	wg.Go(func() { _, firstErr = f.run(cfg) })
	select {
	case <-started:
	case <-time.After(wait):
		t.Fatal("the first replay did not start")
	}
	cfg.Progress = nil
	_, secondErr := f.run(cfg)
	wg.Wait()
	if !errors.Is(firstErr, replay.ErrConflict) && !errors.Is(secondErr, replay.ErrConflict) {
		t.Errorf("two runs of one replay at once returned %v and %v, want one ErrConflict", firstErr, secondErr)
	}
	seen = map[string]bool{}
	for _, m := range f.read("TWICE") {
		if id := m.Headers().Get(nats.MsgIdHdr); seen[id] {
			t.Fatalf("%s stored twice", id)
		} else {
			seen[id] = true
		}
	}
}

// A NATS server restarted while a replay publishes loses nothing and stores nothing twice: the
// replay waits for the connection and resends in order what was not acknowledged.
//
// The restart is made to strike with publishes in flight: from the moment the replay has covered
// 500 messages its publishes to REPLAY vanish on the way (natstest.Dropper) until the server
// has restarted (a server shutting down gracefully answers all it has read, and a restart alone
// may find nothing in flight); the replay must say it resent.
func TestServerRestartMidReplay(t *testing.T) {
	f := newFixture(t, subjects.SingleStream)
	devs := devices("d", 4)
	for _, d := range devs {
		f.put(d, "g")
	}
	f.publish(devs, 500) // 2000
	f.createReplayStream(func(c *jetstream.StreamConfig) { c.Duplicates = time.Minute })
	// The replay's own connection, as kvmapper dials it: no publishing while reconnecting.
	drop := &natstest.Dropper{}
	nc := f.srv.Connect(t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1),
		nats.SetCustomDialer(drop))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncBuf{}
	cfg := f.config()
	cfg.Create, cfg.MaxRate, cfg.ReportInterval, cfg.PublishTimeout = false, 4000, 10*time.Millisecond, time.Second
	cfg.Logger = zerolog.New(logs)
	half := make(chan struct{})
	var once sync.Once
	cfg.Progress = func(p replay.Progress) {
		if p.Done >= 500 {
			once.Do(func() {
				drop.Drop("replay.")
				close(half)
			})
		}
	}
	r, err := replay.New(js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-half:
	case err := <-done:
		t.Fatalf("Run returned %v before the restart", err)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		if drop.Dropped() == 0 {
			return errors.New("no publish of the replay dropped yet")
		}
		return nil
	})
	f.srv = f.srv.Restart()
	lost := drop.Dropped()
	drop.Drop("")
	if err := <-done; err != nil {
		t.Fatalf("Run across a server restart: %v", err)
	}
	if s := r.Summary(); !s.Complete {
		t.Fatalf("replay incomplete after a server restart: %+v", s)
	}
	if n := strings.Count(logs.String(), "publish failed; resending in order"); n == 0 {
		t.Errorf("%d publishes lost in the restart, and the replay logged no resend:\n%s", lost, logs)
	}
	t.Logf("%d publishes lost in the restart; summary %+v", lost, r.Summary())
	f.nc, f.js = f.srv.JetStream(t)
	msgs := f.read("REPLAY")
	perDevice(t, msgs)
	if len(msgs) != 2000 {
		t.Errorf("REPLAY holds %d messages, want 2000", len(msgs))
	}
}

// syncBuf is a log sink safe for concurrent use.
type syncBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
