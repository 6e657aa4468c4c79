package bench_test

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// Contenders picks the throughput contenders, and Profile the one the profiles cover.
func TestRunContenders(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := tiny(srv.URL())
	cfg.Only = []bench.Kind{bench.Throughput}
	cfg.Contenders = []bench.ContenderName{bench.KVMapper, bench.HandWritten, bench.RelayCeiling}
	var cpu bytes.Buffer
	cfg.CPUProfile, cfg.Profile = &cpu, bench.RelayCeiling
	rep, err := bench.Run(ctx, cfg)
	if err != nil {
		t.Fatalf("Run() error = %v", err)
	}
	var got []bench.ContenderName
	for _, c := range rep.Throughput.Contenders {
		got = append(got, c.Name)
	}
	if !slices.Equal(got, cfg.Contenders) {
		t.Fatalf("contenders %q, want %q", got, cfg.Contenders)
	}
	for _, name := range []bench.ContenderName{bench.HandWritten, bench.RelayCeiling} {
		if rep.Throughput.Ratio[name] <= 0 {
			t.Errorf("Ratio[%s] = %v, want > 0", name, rep.Throughput.Ratio[name])
		}
	}
	if cpu.Len() == 0 {
		t.Errorf("no CPU profile of %s", bench.RelayCeiling)
	}
}

// WriteSweep puts one row per run and checks each scale target between two runs that differ in
// that dimension alone.
func TestWriteSweep(t *testing.T) {
	t.Parallel()
	run := func(layout string, parts, repl, msgs int, kvm, ceiling float64) *bench.Report {
		return &bench.Report{StreamLayout: layout, Throughput: &bench.ThroughputResult{
			Messages: msgs, Partitions: parts, Replicas: repl,
			Contenders: []bench.Contender{{Name: bench.KVMapper, MsgsPerSec: kvm}, {Name: bench.RelayCeiling, MsgsPerSec: ceiling}},
			Ratio:      map[bench.ContenderName]float64{bench.RelayCeiling: kvm / ceiling},
		}}
	}
	reps := []*bench.Report{
		run("single", 16, 1, 100_000, 50_000, 60_000),
		run("single", 16, 1, 1_000_000, 40_000, 60_000), // 0.80 of the 100k rate
		run("single", 64, 1, 100_000, 48_000, 60_000),   // 0.96 of 16 partitions
		run("single", 16, 3, 100_000, 45_000, 60_000),   // 0.90 of 1 replica
	}
	var out bytes.Buffer
	if err := bench.WriteSweep(&out, reps); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	t.Log("\n" + text)
	for _, want := range []string{
		"× relay ceiling, fast batches",
		"1000000   40000            0.67",
		"16 partitions, 1 replicas, 1000000 messages: rate ≥ 0.9× the rate at 100000 messages: MISSED (0.80)",
		"64 partitions, 1 replicas, 100000 messages: rate ≥ 0.9× the rate at 16 partitions: met (0.96)",
		"16 partitions, 3 replicas, 100000 messages: rate ≥ 0.9× the rate at 1 replicas: met (0.90)",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("WriteSweep() output lacks %q", want)
		}
	}
}
