package election_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// logLines collects the JSON lines of a logger written to from many goroutines.
type logLines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// with returns the lines whose message is msg.
func (l *logLines) with(t *testing.T, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range bytes.Split(l.buf.Bytes(), []byte("\n")) {
		if len(line) == 0 {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal(line, &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if m["message"] == msg {
			out = append(out, m)
		}
	}
	return out
}

func partitionsOf(t *testing.T, m map[string]any) []int {
	t.Helper()
	raw, ok := m["partitions"].([]any)
	if !ok {
		t.Fatalf("log line %v has no partitions list", m)
	}
	var ps []int
	for _, v := range raw {
		ps = append(ps, int(v.(float64)))
	}
	return ps
}

// TestStartAndStopLogOneLineEach: a replica that claims all 16 partitions at start logs one
// "partitions claimed" line naming them, with the time they were unowned in milliseconds, and
// releasing them all at shutdown logs one "partitions released" line; the per-partition lines
// are debug.
func TestStartAndStopLogOneLineEach(t *testing.T) {
	t.Parallel()
	const n = 16
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	newBucket(t, js)
	logs := &logLines{}
	tr := newTracker(t)
	r := startReplica(t, srv, "a", n, tr.work("a"), func(c *election.Config) {
		c.Logger = zerolog.New(logs).Level(zerolog.InfoLevel)
	})
	natstest.Eventually(t, 20*time.Second, ownsCount(r, n, n))
	// Owned counts a claim the moment it is taken; the pass's line follows at its end.
	natstest.Eventually(t, 5*time.Second, func() error {
		if len(logs.with(t, "partitions claimed")) == 0 {
			return fmt.Errorf("no partitions claimed line yet")
		}
		return nil
	})
	claimed := logs.with(t, "partitions claimed")
	if len(claimed) != 1 || !slices.Equal(partitionsOf(t, claimed[0]), all(n)) {
		t.Fatalf("partitions claimed lines = %v, want one naming all %d", claimed, n)
	}
	if _, ok := claimed[0]["unowned_ms"].(float64); !ok {
		t.Errorf("partitions claimed line %v: no unowned_ms", claimed[0])
	}
	if got := logs.with(t, "partition claimed"); len(got) != 0 {
		t.Errorf("%d per-partition claim lines at info level, want none", len(got))
	}

	if err := r.stop(t); err != nil {
		t.Fatalf("Run() = %v", err)
	}
	released := logs.with(t, "partitions released")
	if len(released) != 1 || !slices.Equal(partitionsOf(t, released[0]), all(n)) {
		t.Fatalf("partitions released lines = %v, want one naming all %d", released, n)
	}
	if got := logs.with(t, "partition released"); len(got) != 0 {
		t.Errorf("%d per-partition release lines at info level, want none", len(got))
	}
}
