package bench_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/subjects"
)

// The bench's lists are read, and refused in the flags' words, before anything starts.
func TestParseSweep(t *testing.T) {
	t.Parallel()
	w, err := bench.ParseSweep("100_000, 1000000", "16", "1,3", "single,streams")
	if err != nil {
		t.Fatalf("ParseSweep() = %v", err)
	}
	if !slices.Equal(w.Messages, []int{100_000, 1_000_000}) || !slices.Equal(w.Partitions, []int{16}) || !slices.Equal(w.Replicas, []int{1, 3}) ||
		!slices.Equal(w.Layouts, []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams}) || w.Runs() != 8 {
		t.Errorf("ParseSweep() = %+v (%d runs), want 2 messages × 1 partition count × 2 replica counts × 2 layouts", w, w.Runs())
	}
	for _, tc := range []struct {
		lists [4]string
		want  string
	}{
		{[4]string{"1000,many", "16", "1", "single"}, `invalid value "many" for flag --messages: want positive integers, comma-separated`},
		{[4]string{"1000", "0", "1", "single"}, `invalid value "0" for flag --partitions: want positive integers, comma-separated`},
		{[4]string{"1000", "16", ",", "single"}, "flag --replicas is empty"},
		{[4]string{"1000", "16", "1", "single,sharded"}, `invalid value "sharded" for flag --layout: use single or streams`},
		{[4]string{"1000", "16", "1", " "}, "flag --layout is empty"},
	} {
		_, err := bench.ParseSweep(tc.lists[0], tc.lists[1], tc.lists[2], tc.lists[3])
		if err == nil || err.Error() != tc.want || !errors.Is(err, bench.ErrInvalidConfig) {
			t.Errorf("ParseSweep(%q) = %v, want an ErrInvalidConfig saying %q", tc.lists, err, tc.want)
		}
	}
	if _, err := bench.ParseContender("contenders", "fastest"); err == nil || !errors.Is(err, bench.ErrInvalidConfig) ||
		err.Error() != `invalid value "fastest" for flag --contenders: choose among copy, transform, kvmapper, no-provenance, hand-written, relay-async, relay-ceiling, relay-atomic, naive` {
		t.Errorf("ParseContender(fastest) = %v, want an ErrInvalidConfig naming the flag and the contenders", err)
	}
	if name, err := bench.ParseContender("profile-contender", "relay-ceiling"); name != bench.RelayCeiling || err != nil {
		t.Errorf("ParseContender(relay-ceiling) = %q, %v; want %q", name, err, bench.RelayCeiling)
	}
}

// A sweep of several runs is the throughput bench alone, without profiles, and on the bench's own
// server when it lists partitions or layouts; one run takes any sub-benchmark.
func TestSweepFit(t *testing.T) {
	t.Parallel()
	one := bench.Sweep{Messages: []int{1}, Partitions: []int{16}, Replicas: []int{1}, Layouts: []subjects.StreamLayout{subjects.SingleStream}}
	many := one
	many.Partitions = []int{16, 64}
	for _, tc := range []struct {
		name      string
		w         bench.Sweep
		cfg       bench.Config
		srv       bench.ServerConfig
		profiling bool
		want      string
	}{
		{"other sub-benchmark", many, bench.Config{Only: []bench.Kind{bench.Latency}}, bench.ServerConfig{}, false, "run the throughput bench only"},
		{"profile", many, bench.Config{}, bench.ServerConfig{}, true, "profiles cover one run"},
		{"own server", many, bench.Config{URL: "nats://127.0.0.1:1"}, bench.ServerConfig{}, false, "need the bench's own server"},
		{"server profile", one, bench.Config{URL: "nats://127.0.0.1:1"}, bench.ServerConfig{CPUProfile: "x"}, false, "--server-cpuprofile needs the bench's own server: drop --server"},
		{"cluster of one", one, bench.Config{}, bench.ServerConfig{Nodes: 1}, false, `invalid value "1" for flag --cluster`},
		{"cluster and server", one, bench.Config{URL: "nats://127.0.0.1:1"}, bench.ServerConfig{Nodes: 3}, false, "--cluster starts the bench's own servers"},
		{"cluster and replicas", one, bench.Config{StreamReplicas: 3}, bench.ServerConfig{Nodes: 3}, false, "drop --stream-replicas"},
		{"replicas without a cluster", one, bench.Config{StreamReplicas: 3}, bench.ServerConfig{}, false, "--stream-replicas needs a cluster"},
		{"cluster and latency", one, bench.Config{Only: []bench.Kind{bench.Latency}}, bench.ServerConfig{Nodes: 3}, false, "a cluster runs the throughput bench only"},
	} {
		err := tc.w.Fit(&tc.cfg, tc.srv, tc.profiling)
		if err == nil || !errors.Is(err, bench.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Fit() = %v, want an ErrInvalidConfig saying %q", tc.name, err, tc.want)
		}
	}
	cfg := bench.Config{}
	if err := many.Fit(&cfg, bench.ServerConfig{}, false); err != nil || !slices.Equal(cfg.Only, []bench.Kind{bench.Throughput}) {
		t.Errorf("Fit() of %d runs = %v with Only %v, want nil with [throughput]", many.Runs(), err, cfg.Only)
	}
	cfg = bench.Config{}
	if err := one.Fit(&cfg, bench.ServerConfig{Nodes: 3}, true); err != nil || !slices.Equal(cfg.Only, []bench.Kind{bench.Throughput}) {
		t.Errorf("Fit() on a cluster = %v with Only %v, want nil with [throughput]", err, cfg.Only)
	}
	cfg = bench.Config{Only: []bench.Kind{bench.Latency}, URL: "nats://127.0.0.1:1"}
	if err := one.Fit(&cfg, bench.ServerConfig{}, true); err != nil || !slices.Equal(cfg.Only, []bench.Kind{bench.Latency}) {
		t.Errorf("Fit() of one run = %v with Only %v, want nil with [latency]", err, cfg.Only)
	}
}

// CreateProfiles creates the files asked for, the memory profile's .base beside it, and nothing else.
func TestCreateProfiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	var cfg bench.Config
	done, err := cfg.CreateProfiles("", filepath.Join(dir, "mem"))
	if err != nil {
		t.Fatalf("CreateProfiles() = %v", err)
	}
	done()
	entries, _ := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"mem", "mem.base"}) || cfg.CPUProfile != nil || cfg.MemProfile == nil || cfg.MemProfileBase == nil {
		t.Errorf("CreateProfiles(\"\", mem) made %v, cpu %v; want mem and mem.base, no CPU profile", names, cfg.CPUProfile)
	}
	if _, err := cfg.CreateProfiles(filepath.Join(dir, "no", "cpu"), ""); err == nil {
		t.Errorf("CreateProfiles() into a missing directory = nil error")
	}
}
