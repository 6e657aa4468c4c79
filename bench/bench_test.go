package bench_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/subjects"
)

// tiny is a configuration small enough for a test: it checks that every sub-benchmark runs and
// reports sane figures, not how fast anything is.
func tiny(url string) bench.Config {
	return bench.Config{
		URL:           url,
		Messages:      2000,
		NaiveMessages: 500,
		Devices:       100,
		Rate:          1000,
		Duration:      time.Second,
		Changes:       10,
		ChangeLoad:    500,
		TableDevices:  2000,
		FailoverRate:  500,
		Child:         testChild,
	}
}

func TestRun(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := bench.Run(ctx, tiny(srv.URL()))
	if err != nil {
		t.Fatalf("Run() error = %v", err)
	}

	tp := rep.Throughput
	if tp == nil {
		t.Fatal("Run().Throughput = nil")
	}
	want := map[bench.ContenderName]uint64{bench.Copy: 2000, bench.Transform: 2000, bench.KVMapper: 2000, bench.KVMapperBare: 2000,
		bench.HandWritten: 2000, bench.RelayAsync: 2000, bench.RelayCeiling: 2000, bench.RelayAtomic: 2000, bench.Naive: 500}
	if len(tp.Contenders) != len(want) {
		t.Errorf("%d contenders, want %d", len(tp.Contenders), len(want))
	}
	for _, c := range tp.Contenders {
		if c.Messages != want[c.Name] {
			t.Errorf("%s: Messages = %d, want %d", c.Name, c.Messages, want[c.Name])
		}
		if c.MsgsPerSec <= 0 {
			t.Errorf("%s: MsgsPerSec = %v, want > 0", c.Name, c.MsgsPerSec)
		}
		if c.Name != bench.KVMapper && tp.Ratio[c.Name] <= 0 {
			t.Errorf("Ratio[%s] = %v, want > 0", c.Name, tp.Ratio[c.Name])
		}
	}
	if tp.AllocsPerMsg <= 0 || tp.BytesPerMsg <= 0 {
		t.Errorf("AllocsPerMsg, BytesPerMsg = %v, %v; want > 0", tp.AllocsPerMsg, tp.BytesPerMsg)
	}

	l := rep.Latency
	if l == nil {
		t.Fatal("Run().Latency = nil")
	}
	for name, r := range map[string]bench.LatencyRun{"direct": l.Direct, "relay": l.Relay, "kvmapper": l.KVMapper} {
		if r.Sent == 0 || r.Received != r.Sent {
			t.Errorf("%s: Sent, Received = %d, %d; want equal and > 0", name, r.Sent, r.Received)
		}
		if q := r.Latency; q.Samples == 0 || q.P50 <= 0 || q.P99 < q.P50 || q.Max < q.P99 {
			t.Errorf("%s: Latency = %+v, want 0 < p50 ≤ p99 ≤ max", name, q)
		}
	}

	m := rep.Mapping
	if m == nil {
		t.Fatal("Run().Mapping = nil")
	}
	if m.Latency.Samples+m.TimedOut != 10 || m.Latency.Samples == 0 || m.Latency.P50 <= 0 {
		t.Errorf("Mapping = %+v, want 10 changes timed", m)
	}

	tb := rep.Table
	if tb == nil {
		t.Fatal("Run().Table = nil")
	}
	if tb.Devices != 2000 || tb.Ready <= 0 || tb.LookupNs <= 0 {
		t.Errorf("Table = %+v, want 2000 devices, positive ready time and lookup (bytes per device is noise at this size with the server in the process)", tb)
	}

	f := rep.Failover
	if f == nil {
		t.Fatal("Run().Failover = nil")
	}
	if len(f.Gaps) == 0 || f.MaxKillToClaim <= 0 || f.MaxKillToOutput < f.MaxKillToClaim {
		t.Errorf("Failover = %+v, want gaps with output after the claim", f)
	}
	if f.Published == 0 || f.Lost != 0 {
		t.Errorf("Failover published %d, lost %d; want > 0 and 0", f.Published, f.Lost)
	}

	// The server maps no direct subjects: the direct run measures every path but the two mapped ones.
	d := rep.Direct
	if d == nil {
		t.Fatal("Run().Direct = nil")
	}
	wantPaths := []string{bench.PathStraight, bench.PathStream, bench.PathDirectAll}
	var got []string
	for _, p := range d.Paths {
		got = append(got, p.Name)
		if p.Errors != 0 || p.Sent == 0 || p.Ack.Samples == 0 || p.Ack.P50 <= 0 || p.Delivery.Samples == 0 ||
			p.AckedPerSec <= 0 || p.StoredPerSec <= 0 || p.Messages != 2000 {
			t.Errorf("direct path %+v, want acknowledgements, deliveries and rates of 2000 messages, and no error", p)
		}
	}
	if !slices.Equal(got, wantPaths) || d.Skipped[bench.PathDirectMapped] == "" || d.Skipped[bench.PathDirectProvenance] == "" {
		t.Errorf("direct paths %v (skipped %v), want %v and the mapped paths skipped on a server without the mapping", got, d.Skipped, wantPaths)
	}

	var text bytes.Buffer
	if err := rep.WriteText(&text); err != nil {
		t.Fatalf("WriteText() error = %v", err)
	}
	for _, s := range []string{"THROUGHPUT", "LATENCY", "MAPPING CHANGE", "TABLE", "FAILOVER", "DIRECT MODE", string(bench.Naive), string(bench.RelayCeiling), "targets (issue 10)"} {
		if !strings.Contains(text.String(), s) {
			t.Errorf("WriteText() output lacks %q:\n%s", s, text.String())
		}
	}
	if _, err := json.Marshal(rep); err != nil {
		t.Errorf("json.Marshal(report) error = %v", err)
	}

	// The bench removes what it created.
	_, js := srv.JetStream(t)
	names := js.StreamNames(ctx)
	var left []string
	for n := range names.Name() {
		left = append(left, n)
	}
	if len(left) != 0 {
		t.Errorf("streams left after Run: %v, want none", left)
	}
}

// In the partition-streams layout the contenders read every partition stream: the server maps
// the device subjects into them, and the naive mapper does not run.
func TestRunPartitionStreams(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.GlobalAccount().AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := tiny(srv.URL())
	cfg.Only = []bench.Kind{bench.Throughput, bench.Failover}
	cfg.StreamLayout = subjects.PartitionStreams
	cfg.Replicas = 3
	rep, err := bench.Run(ctx, cfg)
	if err != nil {
		t.Fatalf("Run() error = %v", err)
	}
	tp := rep.Throughput
	want := map[bench.ContenderName]uint64{bench.Copy: 2000, bench.Transform: 2000, bench.KVMapper: 2000, bench.KVMapperBare: 2000,
		bench.HandWritten: 2000, bench.RelayAsync: 2000, bench.RelayCeiling: 2000, bench.RelayAtomic: 2000}
	if tp == nil || len(tp.Contenders) != len(want) || rep.StreamLayout != "streams" {
		t.Fatalf("Run() = layout %q, throughput %+v; want the streams layout and %d contenders", rep.StreamLayout, tp, len(want))
	}
	for _, c := range tp.Contenders {
		if c.Messages != want[c.Name] || c.MsgsPerSec <= 0 {
			t.Errorf("%s: Messages = %d at %v msgs/s, want %d", c.Name, c.Messages, c.MsgsPerSec, want[c.Name])
		}
	}
	if f := rep.Failover; f == nil || f.Published == 0 || f.Lost != 0 {
		t.Errorf("Failover = %+v, want messages published and none lost", f)
	}
	var text bytes.Buffer
	if err := rep.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"16 partitions (streams layout), 3 kvmapper replica(s)", "naive: not run"} {
		if !strings.Contains(text.String(), s) {
			t.Errorf("WriteText() output lacks %q:\n%s", s, text.String())
		}
	}
}

func TestRunRefusesForeignStreams(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	cfg := tiny(srv.URL())
	cfg.Only = []bench.Kind{bench.TableScale}
	if _, err := bench.Run(ctx, cfg); !errors.Is(err, bench.ErrForeignStreams) {
		t.Errorf("Run() error = %v, want ErrForeignStreams", err)
	}
}

func TestRunInvalidConfig(t *testing.T) {
	t.Parallel()
	for name, mod := range map[string]func(*bench.Config){
		"no url":          func(c *bench.Config) { c.URL = "" },
		"unknown only":    func(c *bench.Config) { c.Only = []bench.Kind{"speed"} },
		"small payload":   func(c *bench.Config) { c.Payload = 4 },
		"stream layout":   func(c *bench.Config) { c.StreamLayout = "sharded" },
		"contender":       func(c *bench.Config) { c.Contenders = []bench.ContenderName{"kvmapper", "the fastest"} },
		"profile":         func(c *bench.Config) { c.Profile = "nobody" },
		"cluster latency": func(c *bench.Config) { c.StreamReplicas = 3; c.Only = []bench.Kind{bench.Latency} },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := tiny("nats://127.0.0.1:1")
			mod(&cfg)
			if _, err := bench.Run(context.Background(), cfg); !errors.Is(err, bench.ErrInvalidConfig) {
				t.Errorf("Run() error = %v, want ErrInvalidConfig", err)
			}
		})
	}
}
