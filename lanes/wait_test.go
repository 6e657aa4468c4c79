package lanes_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/subjects"
)

// logLines is a zerolog destination tests read while the pool writes.
type logLines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// String returns every line so far.
func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// has reports whether a line holds every one of parts.
func (l *logLines) has(parts ...string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
lines:
	for line := range strings.Lines(l.buf.String()) { // under l.mu
		for _, p := range parts {
			if !strings.Contains(line, p) {
				continue lines
			}
		}
		return true
	}
	return false
}

// waiting returns what the pool's lane of partition p waits for, nil when nothing.
func waiting(pool *lanes.Pool, p int) *lanes.Wait {
	for _, s := range pool.Partitions() {
		if s.Partition == p {
			return s.Waiting
		}
	}
	return nil
}

// A publish that gets no answer (OUTGOING without a leader, on one server: its publishes
// vanish) is what the lane waits for: past WaitWarnAfter it is logged with the stream and the
// server, shown in Partitions, and once the stream answers again the wait ends, logged too.
func TestUnansweredPublishShowsAsAWait(t *testing.T) {
	t.Parallel() // waits out timers on a server of its own
	f := newFixture(t)
	dev := "dev-w"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	logs := &logLines{}
	pool, drop := f.droppingPool(lanes.Config{WaitWarnAfter: 300 * time.Millisecond, Logger: zerolog.New(logs)})
	runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1})
	natstest.Eventually(t, 10*time.Second, func() error {
		if len(pool.Partitions()) != 1 {
			return fmt.Errorf("the lane has not fenced yet")
		}
		return nil
	})
	drop.Drop("outgoing.")
	sent := time.Now()
	f.publish([]string{dev}, 1, nil)
	var w *lanes.Wait
	natstest.Eventually(t, 10*time.Second, func() error {
		if w = waiting(pool, p); w == nil || w.For != lanes.WaitPublish {
			return fmt.Errorf("partition %d waits for %+v, want a publish", p, w)
		}
		return nil
	})
	if w.Stream != "OUTGOING" || w.Since.Before(sent.Add(-time.Second)) || w.Since.After(time.Now()) {
		t.Fatalf("wait %+v: want OUTGOING since about %v", w, sent)
	}
	if w.Server != f.srv.Name() {
		t.Fatalf("wait %+v: want the server %s, OUTGOING's leader", w, f.srv.Name())
	}
	natstest.Eventually(t, 5*time.Second, func() error {
		if !logs.has(`"level":"warn"`, `"waiting_for":"publish"`, `"stream":"OUTGOING"`, `"server":"`+w.Server+`"`) {
			return fmt.Errorf("no warning of the wait yet:\n%s", logs.String())
		}
		return nil
	})
	drop.Drop("")
	f.read("OUTGOING", 1)
	natstest.Eventually(t, 10*time.Second, func() error {
		if w := waiting(pool, p); w != nil {
			return fmt.Errorf("partition %d still waits for %+v", p, w)
		}
		if !logs.has(`"level":"info"`, "partition moving again", `"waited_for":"publish"`) {
			return fmt.Errorf("the end of the wait is not logged")
		}
		return nil
	})
}

// A consumer that sends heartbeats and delivers nothing while its stream holds the
// partition's messages (on a cluster: a consumer placed on a server still catching up after a
// restart) is found by asking the stream's leader, logged with its stream and server, and
// replaced: every message arrives, in order. Here the consumer is paused (the server keeps it
// and delivers nothing), and the lane's heartbeat is set to 10s (a paused consumer may miss heartbeats, and two missed would end it after 20s), so that only the
// watcher can find it.
func TestQuietConsumerIsReplaced(t *testing.T) {
	t.Parallel() // waits out timers on a server of its own
	eachLayout(t, func(t *testing.T, f *fixture) {
		dev := "dev-q"
		p := subjects.Partition(dev, 16)
		f.groups.set(dev, "g")
		logs := &logLines{}
		pool := f.newPool(lanes.Config{WaitWarnAfter: 300 * time.Millisecond, Heartbeat: 10 * time.Second, Logger: zerolog.New(logs)})
		runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1})
		stream := f.stream(dev)
		var paused string
		ctx := context.Background()
		natstest.Eventually(t, 10*time.Second, func() error {
			names := f.lanesConsumers(stream, p)
			if len(names) != 1 {
				return fmt.Errorf("consumers of partition %d on %s: %v, want one", p, stream, names)
			}
			paused = names[0]
			return nil
		})
		if _, err := f.js.PauseConsumer(ctx, stream, paused, time.Now().Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
		const n = 20
		f.publish([]string{dev}, n, nil)
		natstest.Eventually(t, 10*time.Second, func() error {
			if !logs.has(`"level":"warn"`, `"waiting_for":"consumer"`, `"stream":"`+stream+`"`, `"server":"`+f.srv.Name()+`"`) {
				return fmt.Errorf("no warning of the quiet consumer yet:\n%s", logs.String())
			}
			return nil
		})
		checkOrder(t, f.read("OUTGOING", n), []string{dev}, n, func(d string) string { return "outgoing.g." + d + ".evt" })
		if names := f.lanesConsumers(stream, p); len(names) != 1 || names[0] == paused {
			t.Fatalf("consumers of partition %d: %v; want one, not the paused %s", p, names, paused)
		}
		natstest.Eventually(t, 10*time.Second, func() error {
			if w := waiting(pool, p); w != nil {
				return fmt.Errorf("partition %d still waits for %+v", p, w)
			}
			return nil
		})
	})
}

// An idle partition is not a quiet consumer: with nothing to deliver, the lane keeps its
// consumer and logs nothing.
func TestIdleConsumerIsKept(t *testing.T) {
	t.Parallel() // waits out timers on a server of its own
	f := newFixture(t)
	dev := "dev-i"
	p := subjects.Partition(dev, 16)
	f.groups.set(dev, "g")
	logs := &logLines{}
	pool := f.newPool(lanes.Config{WaitWarnAfter: 100 * time.Millisecond, Logger: zerolog.New(logs).Level(zerolog.InfoLevel)})
	runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1})
	f.publish([]string{dev}, 3, nil)
	f.read("OUTGOING", 3)
	stream := f.stream(dev)
	before := f.lanesConsumers(stream, p)
	// Ten of the watcher's intervals, each of which asks the leader and finds nothing.
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if w := waiting(pool, p); w != nil {
			t.Fatalf("an idle partition waits for %+v", w)
		}
		tick := time.NewTimer(20 * time.Millisecond)
		<-tick.C
	}
	if after := f.lanesConsumers(stream, p); len(before) != 1 || len(after) != 1 || before[0] != after[0] {
		t.Fatalf("consumers before %v, after %v: want the same one", before, after)
	}
	if logs.has("waiting_for") {
		t.Fatalf("an idle partition logged a wait:\n%s", logs.String())
	}
}

// lanesConsumers returns the names of the lanes' consumers of partition p on stream.
func (f *fixture) lanesConsumers(stream string, p int) []string {
	f.t.Helper()
	s, err := f.js.Stream(context.Background(), stream)
	if err != nil {
		f.t.Fatal(err)
	}
	var out []string
	names := s.ConsumerNames(context.Background())
	for name := range names.Name() {
		if strings.HasPrefix(name, fmt.Sprintf("kvmapper_%d_", p)) {
			out = append(out, name)
		}
	}
	if err := names.Err(); err != nil && err != jetstream.ErrEndOfData {
		f.t.Fatal(err)
	}
	return out
}
