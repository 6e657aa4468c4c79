package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/metrics"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// TestMetricsOfARealPool maps messages with a real lanes.Pool and kv.Table on an embedded
// server, wired to Metrics the way main does, and reads them over HTTP.
func TestMetricsOfARealPool(t *testing.T) {
	srv := natstest.Start(t)
	nc, js := srv.JetStream(t, nats.ReconnectBufSize(-1))
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 4)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: lay}); err != nil {
		t.Fatal(err)
	}
	groups, err := js.KeyValue(ctx, "device-groups")
	if err != nil {
		t.Fatal(err)
	}
	ctl, err := js.KeyValue(ctx, "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := groups.PutString(ctx, "dev-1", "group-a"); err != nil {
		t.Fatal(err)
	}

	var m *metrics.Metrics
	table, err := kv.New(groups, kv.Config{OnUpdate: func(u kv.Update) {
		if !u.Initial {
			m.ObserveTableUpdate(u.Deleted)
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := lanes.New(js, ctl, func(device string) subjects.Mapping {
		e, ok := table.Lookup(device)
		if !ok {
			return subjects.Unmappable(wire.ReasonNoMapping, "", "", 0)
		}
		return e.Mapping()
	}, lanes.Config{Layout: lay, CheckpointInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	m, err = metrics.New(func(context.Context) metrics.Snapshot {
		st := pool.Stats()
		s := metrics.Snapshot{Mapped: st.Mapped, Unmapped: st.Unmapped, Duplicates: st.Duplicates, Retries: st.Retries,
			Failures: st.Failures, InFlight: st.InFlight, TableDevices: table.Len(), TableRevision: table.Revision(), WatchLag: -1}
		for _, p := range pool.Partitions() {
			s.Partitions = append(s.Partitions, metrics.Partition{Partition: p.Partition, Epoch: p.Epoch, Acked: p.Acked, Checkpoint: p.Checkpoint, Lag: p.Lag()})
		}
		s.Owned = len(s.Partitions)
		return s
	}, metrics.Config{
		Replica:         "r0",
		Version:         "dev",
		Partitions:      lay.Partitions,
		UnmappedReasons: []string{wire.ReasonNoMapping, wire.ReasonInvalidGroup},
		Ready: func() error {
			if !nc.IsConnected() {
				return errors.New("not connected to NATS")
			}
			select {
			case <-table.Ready():
				return nil
			default:
				return errors.New("groups table not loaded yet")
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(m.Handler())
	defer hs.Close()

	if code, body := get(t, hs.URL+"/healthz"); code != http.StatusOK {
		t.Errorf("GET /healthz = %d %q, want 200", code, body)
	}
	if code, body := get(t, hs.URL+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "groups table not loaded") {
		t.Errorf("GET /readyz before the table loaded = %d %q, want 503 naming the table", code, body)
	}
	if _, body := get(t, hs.URL+"/metrics"); !strings.Contains(body, "\nkvmapper_ready 0\n") {
		t.Errorf("GET /metrics before the table loaded lacks kvmapper_ready 0")
	}

	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { _ = table.Run(ctx) })
	<-table.Ready()
	for p := range lay.Partitions {
		wg.Go(func() { _ = pool.Run(ctx, lanes.Assignment{Partition: p, Epoch: 1}) })
	}
	if code, body := get(t, hs.URL+"/readyz"); code != http.StatusOK {
		t.Errorf("GET /readyz after the table loaded = %d %q, want 200", code, body)
	}

	// Every name is there before any message.
	_, body := get(t, hs.URL+"/metrics")
	for _, name := range []string{
		"kvmapper_mapped_total 0", `kvmapper_unmapped_total{reason="no-mapping"} 0`, "kvmapper_duplicates_total",
		"kvmapper_publish_retries_total", "kvmapper_publish_failures_total", "kvmapper_in_flight",
		"kvmapper_partitions_owned", `kvmapper_ownership_changes_total{change="acquired"} 0`, "kvmapper_unowned_gap_seconds_bucket",
		"kvmapper_table_devices 1", "kvmapper_table_revision 1", `kvmapper_table_updates_total{op="put"} 0`,
		`kvmapper_build_info{replica="r0",version="dev"} 1`, "kvmapper_events_dropped_total", "go_goroutines", "process_",
		"\nkvmapper_ready 1\n", "\nkvmapper_fenced_total 0\n", "\nkvmapper_fence_write_failures_total 0\n",
		"\nkvmapper_partitions_configured 4\n",
	} {
		if !strings.Contains(body, name) {
			t.Errorf("GET /metrics lacks %q", name)
		}
	}

	// Map 10 messages, leave 3 unmapped, change the table once: the values follow.
	for i := range 10 {
		if _, err := js.Publish(ctx, "incoming.dev-1.t", fmt.Appendf(nil, "%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		if _, err := js.Publish(ctx, "incoming.dev-unknown.t", nil); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := groups.PutString(ctx, "dev-2", "group-b"); err != nil {
		t.Fatal(err)
	}
	m.ObserveOwnership(metrics.ChangeAcquired, 1500*time.Millisecond)
	m.ObserveFenceWriteFailure()
	devPart := fmt.Sprintf(`kvmapper_partition_checkpoint_sequence{partition="%d"}`, subjects.Partition("dev-1", 4))
	natstest.Eventually(t, 10*time.Second, func() error {
		_, body := get(t, hs.URL+"/metrics")
		for _, want := range []string{
			"kvmapper_mapped_total 10", `kvmapper_unmapped_total{reason="no-mapping"} 3`, "kvmapper_partitions_owned 4",
			`kvmapper_table_updates_total{op="put"} 1`, "kvmapper_table_devices 2", devPart,
			`kvmapper_ownership_changes_total{change="acquired"} 1`, "kvmapper_unowned_gap_seconds_count 1",
			"\nkvmapper_fence_write_failures_total 1\n",
		} {
			if !strings.Contains(body, want) {
				return fmt.Errorf("GET /metrics lacks %q", want)
			}
		}
		return nil
	})
	// The registry gathers without errors (no inconsistent or duplicate series).
	if _, err := m.Registry().Gather(); err != nil {
		t.Errorf("Registry().Gather() = %v", err)
	}
}

func TestServeStopsWithContext(t *testing.T) {
	m, err := metrics.New(func(context.Context) metrics.Snapshot { return metrics.Snapshot{WatchLag: 3} }, metrics.Config{
		Ready: func() error { return errors.New("not connected to NATS") },
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, ln) }()
	url := "http://" + ln.Addr().String()
	if code, body := get(t, url+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "not connected") {
		t.Errorf("GET /readyz = %d %q, want 503 with the reason", code, body)
	}
	if _, body := get(t, url+"/metrics"); !strings.Contains(body, "kvmapper_table_watch_lag_revisions 3") {
		t.Errorf("GET /metrics lacks the watch lag:\n%s", body)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve() = %v, want nil", err)
	}
}

func TestNewRejectsNilSource(t *testing.T) {
	if _, err := metrics.New(nil, metrics.Config{}); !errors.Is(err, metrics.ErrInvalidConfig) {
		t.Fatalf("New(nil) = %v, want ErrInvalidConfig", err)
	}
	src := func(context.Context) metrics.Snapshot { return metrics.Snapshot{} }
	if _, err := metrics.New(src, metrics.Config{Partitions: -1}); !errors.Is(err, metrics.ErrInvalidConfig) {
		t.Fatalf("New(Partitions: -1) = %v, want ErrInvalidConfig", err)
	}
}

// The partition count is exported only when it is known: an alert compares it with the leases
// held, and a 0 would read as "nothing to own".
func TestPartitionsConfigured(t *testing.T) {
	for _, tc := range []struct {
		partitions int
		want       string // a line of the exposition; "" for none
	}{{16, "\nkvmapper_partitions_configured 16\n"}, {0, ""}} {
		m, err := metrics.New(func(context.Context) metrics.Snapshot { return metrics.Snapshot{WatchLag: -1} }, metrics.Config{Partitions: tc.partitions})
		if err != nil {
			t.Fatal(err)
		}
		hs := httptest.NewServer(m.Handler())
		_, body := get(t, hs.URL+"/metrics")
		hs.Close()
		if got := strings.Contains(body, "kvmapper_partitions_configured"); got != (tc.want != "") || (tc.want != "" && !strings.Contains(body, tc.want)) {
			t.Errorf("Partitions %d: GET /metrics has kvmapper_partitions_configured = %v, want the line %q", tc.partitions, got, tc.want)
		}
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// The streams' replication and the lease TTL, as a replica on a cluster reports them: a leader
// per stream, each follower's lag and state, and no leader while one is elected.
func TestStreamReplication(t *testing.T) {
	m, err := metrics.New(func(context.Context) metrics.Snapshot {
		return metrics.Snapshot{WatchLag: -1, LeaseTTL: 15 * time.Second, WatchRestarts: 2, Streams: []metrics.Stream{
			{Name: "OUTGOING", Replicas: 3, Leader: "n1", Followers: []metrics.Follower{
				{Server: "n0", Current: true, SeenAgo: 200 * time.Millisecond},
				{Server: "n2", Lag: 42, SeenAgo: 3 * time.Second},
			}},
			{Name: "KV_kvmapper", Replicas: 3, Followers: []metrics.Follower{{Server: "n0"}, {Server: "n1"}}},
		}, WriteModes: map[string]string{"OUTGOING": "atomic", "UNMAPPED": "single"}}
	}, metrics.Config{Replica: "r0"})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(m.Handler())
	defer hs.Close()
	_, body := get(t, hs.URL+"/metrics")
	for _, want := range []string{
		"kvmapper_lease_ttl_seconds 15",
		"\nkvmapper_control_watch_restarts_total 2\n",
		`kvmapper_stream_replicas{stream="OUTGOING"} 3`,
		`kvmapper_stream_has_leader{stream="OUTGOING"} 1`,
		`kvmapper_stream_leader{server="n1",stream="OUTGOING"} 1`,
		`kvmapper_stream_follower_current{server="n0",stream="OUTGOING"} 1`,
		`kvmapper_stream_follower_current{server="n2",stream="OUTGOING"} 0`,
		`kvmapper_stream_follower_lag{server="n2",stream="OUTGOING"} 42`,
		`kvmapper_stream_follower_seen_seconds{server="n2",stream="OUTGOING"} 3`,
		`kvmapper_stream_has_leader{stream="KV_kvmapper"} 0`,
		`kvmapper_write_mode{mode="atomic",stream="OUTGOING"} 1`,
		`kvmapper_write_mode{mode="single",stream="UNMAPPED"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("GET /metrics lacks %q", want)
		}
	}
	if strings.Contains(body, `kvmapper_stream_leader{server="",stream="KV_kvmapper"}`) {
		t.Errorf("GET /metrics names a leader for a stream without one")
	}
	if _, err := m.Registry().Gather(); err != nil {
		t.Errorf("Registry().Gather() = %v", err)
	}
}

// A partition's wait shows in seconds, and 0 for one that does not wait.
func TestPartitionWait(t *testing.T) {
	m, err := metrics.New(func(context.Context) metrics.Snapshot {
		return metrics.Snapshot{WatchLag: -1, Partitions: []metrics.Partition{{Partition: 1}, {Partition: 2, Waiting: 4500 * time.Millisecond}}}
	}, metrics.Config{Ready: func() error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(m.Handler())
	defer hs.Close()
	_, body := get(t, hs.URL+"/metrics")
	for _, want := range []string{"\nkvmapper_partition_wait_seconds{partition=\"1\"} 0\n", "\nkvmapper_partition_wait_seconds{partition=\"2\"} 4.5\n"} {
		if !strings.Contains(body, want) {
			t.Errorf("GET /metrics lacks %q", want)
		}
	}
}
