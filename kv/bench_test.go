package kv_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
)

const benchDevices = 1_000_000

func deviceIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("dev-%07d", i)
	}
	return ids
}

func loadedTable(b *testing.B, ids []string) *kv.Table {
	b.Helper()
	tb := kv.NewUnbound(kv.Config{})
	for i, id := range ids {
		tb.PutForTest(id, fmt.Sprintf("group-%d", i%100), uint64(i+1))
	}
	return tb
}

func BenchmarkLookup(b *testing.B) {
	ids := deviceIDs(benchDevices)
	tb := loadedTable(b, ids)
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if _, ok := tb.Lookup(ids[i]); !ok {
				b.Fatalf("Lookup(%s) ok = false", ids[i])
			}
			i++
			if i == len(ids) {
				i = 0
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.SetParallelism(8) // 16 goroutines on 2 cores
		b.RunParallel(func(pb *testing.PB) {
			i := int(time.Now().UnixNano() % benchDevices)
			for pb.Next() {
				if _, ok := tb.Lookup(ids[i]); !ok {
					b.Errorf("Lookup(%s) ok = false", ids[i])
					return
				}
				i++
				if i == len(ids) {
					i = 0
				}
			}
		})
	})
	// A plain map of the same size, on the same machine: the floor set by cache misses.
	b.Run("baseline-gomap", func(b *testing.B) {
		m := make(map[string]uint64, len(ids))
		for i, id := range ids {
			m[strings.Clone(id)] = uint64(i)
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if _, ok := m[ids[i]]; !ok {
				b.Fatalf("m[%s] ok = false", ids[i])
			}
			i++
			if i == len(ids) {
				i = 0
			}
		}
	})
	b.Run("missing", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := tb.Lookup("dev-unknown"); ok {
				b.Fatal("Lookup(dev-unknown) ok = true")
			}
		}
	})
}

// BenchmarkMemory reports the heap the table holds per device, key strings included.
func BenchmarkMemory(b *testing.B) {
	ids := deviceIDs(benchDevices)
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		tb := loadedTable(b, ids)
		runtime.GC()
		runtime.ReadMemStats(&after)
		if tb.Len() != benchDevices {
			b.Fatalf("Len() = %d, want %d", tb.Len(), benchDevices)
		}
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/benchDevices, "B/device")
		runtime.KeepAlive(tb)
	}
}

// BenchmarkLoad1M puts 1M keys through an embedded server, then times Run from start to Ready.
func BenchmarkLoad1M(b *testing.B) {
	srv := natstest.Start(b)
	nc, js := srv.JetStream(b)
	bucket := createBucket(b, js)
	ctx := context.Background()
	const window = 10_000
	pub, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(window))
	if err != nil {
		b.Fatalf("jetstream.New: %v", err)
	}
	ids := deviceIDs(benchDevices)
	putStart := time.Now()
	for start := 0; start < len(ids); start += window {
		futures := make([]jetstream.PubAckFuture, 0, window)
		for _, id := range ids[start:min(start+window, len(ids))] {
			f, err := pub.PublishAsync("$KV.device-groups."+id, []byte("group-a"))
			if err != nil {
				b.Fatalf("PublishAsync: %v", err)
			}
			futures = append(futures, f)
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				b.Fatalf("publish: %v", err)
			}
		}
	}
	b.Logf("put %d keys in %v", len(ids), time.Since(putStart))
	for b.Loop() {
		tb := newTable(b, bucket, kv.Config{})
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- tb.Run(rctx) }()
		select {
		case <-tb.Ready():
		case <-time.After(time.Minute):
			b.Fatal("Ready not closed within a minute")
		}
		b.ReportMetric(time.Since(start).Seconds(), "s/ready")
		if tb.Len() != benchDevices {
			b.Errorf("Len() = %d, want %d", tb.Len(), benchDevices)
		}
		cancel()
		if err := <-done; err != nil {
			b.Errorf("Run() = %v", err)
		}
	}
}
