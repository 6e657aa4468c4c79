package kv_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/subjects"
)

// benchDevices is the table size the benchmarks quote (1M devices), or 100k with -short, as CI's
// run of every benchmark once (-benchtime 1x) passes: there the benchmarks must run, not measure.
func benchDevices() int {
	if testing.Short() {
		return 100_000
	}
	return 1_000_000
}

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
	ids := deviceIDs(benchDevices())
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
			i := int(time.Now().UnixNano() % int64(len(ids)))
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

// BenchmarkMemory reports the heap the table holds per device, key strings included: with a
// group as the value (today's deployments), and with a three-field JSON value that the out
// template and a header use, shared by many devices (a fleet routed on groups, regions and
// tenants) or different for every device (a field that names the device).
//
//	go test -run '^$' -bench Memory -benchtime 1x ./kv/
func BenchmarkMemory(b *testing.B) {
	ids := deviceIDs(benchDevices())
	for _, c := range []struct {
		name   string
		schema *subjects.Schema
		value  func(i int) string
	}{
		{"group", nil, func(i int) string { return fmt.Sprintf("group-%d", i%100) }},
		{"three-fields-shared", benchLayout(b).Schema(), func(i int) string {
			return fmt.Sprintf(`{"group":"group-%d","region":"region-%d","tenant":"tenant-%d"}`, i%100, i%5, i%20)
		}},
		{"three-fields-unique", benchLayout(b).Schema(), func(i int) string {
			return fmt.Sprintf(`{"group":"group-%d","region":"region-%d","tenant":"tenant-%07d"}`, i%100, i%5, i)
		}},
	} {
		values := make([]string, len(ids))
		for i := range values {
			values[i] = c.value(i)
		}
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				tb := kv.NewUnbound(kv.Config{Schema: c.schema})
				for i, id := range ids {
					tb.PutForTest(id, values[i], uint64(i+1))
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				if tb.Len() != benchDevices() || len(tb.Invalid()) != 0 {
					b.Fatalf("Len() = %d, Invalid() = %v; want %d valid", tb.Len(), tb.Invalid(), benchDevices())
				}
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(benchDevices()), "B/device")
				runtime.KeepAlive(tb)
			}
		})
	}
}

// benchLayout routes on three fields of the value and carries one in a header.
func benchLayout(b testing.TB) *subjects.Layout {
	l, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{region}.{tenant}.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		b.Fatal(err)
	}
	if l, err = l.WithHeaders([]string{"Tenant={tenant}"}); err != nil {
		b.Fatal(err)
	}
	return l
}

// BenchmarkLookupRender is what the hot path does per message to map it, as the lanes do it:
// parse the INCOMING subject, look the device up (Table.Mapping), render the output subject and
// the output headers. "group" is today's deployment (a group as the value, the default
// templates); "three-fields" routes on region, tenant and group of a JSON value and carries the
// tenant in a header; "three-fields-no-header" routes the same without the header. On a table of 1M devices, taken in a shuffled order as messages of many
// devices come (memory-bound: a cache miss or two per lookup), and of 10k devices (in the
// caches: the CPU cost alone). kv/testdata/lookup_render_before_issue23.go.txt is the same loop
// for the code before values could be JSON (see BENCHMARKS.md).
//
//	go test -run '^$' -bench LookupRender -count 10 ./kv/
func BenchmarkLookupRender(b *testing.B) {
	def, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		b.Fatal(err)
	}
	noHeaders, err := benchLayout(b).WithHeaders(nil)
	if err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{benchDevices(), 10_000} {
		b.Run(fmt.Sprintf("devices=%d", n), func(b *testing.B) {
			ids := deviceIDs(n)
			stored := make([]string, len(ids))
			order := make([]int, len(ids))
			for i, id := range ids {
				stored[i] = fmt.Sprintf("incoming.%d.%s.temp", subjects.Partition(id, 16), id)
				order[i] = i
			}
			rand.New(rand.NewPCG(1, 2)).Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			for _, c := range []struct {
				name  string
				lay   *subjects.Layout
				value func(i int) string
			}{
				{"group", def, func(i int) string { return fmt.Sprintf("group-%d", i%100) }},
				{"three-fields", benchLayout(b), func(i int) string {
					return fmt.Sprintf(`{"group":"group-%d","region":"region-%d","tenant":"tenant-%d"}`, i%100, i%5, i%20)
				}},
				{"three-fields-no-header", noHeaders, func(i int) string {
					return fmt.Sprintf(`{"group":"group-%d","region":"region-%d","tenant":"tenant-%d"}`, i%100, i%5, i%20)
				}},
			} {
				b.Run(c.name, func(b *testing.B) {
					// The values first, then the table: a table built between other allocations
					// spreads over more memory, which costs the lookups TLB misses of their own.
					values := make([]string, len(ids))
					for i := range values {
						values[i] = c.value(i)
					}
					tb := kv.NewUnbound(kv.Config{Schema: c.lay.Schema()})
					for i, id := range ids {
						tb.PutForTest(id, values[i], uint64(i+1))
					}
					var f subjects.Fields
					buf := make([]byte, 0, 256)
					var hdr [subjects.MaxHeaders]string
					runtime.GC() // the table's garbage collected before the timer starts, not during the loop
					b.ReportAllocs()
					i := 0
					for b.Loop() {
						if err := c.lay.Parse(stored[order[i]], &f); err != nil {
							b.Fatal(err)
						}
						e := tb.Mapping(f.Device()) // what the lanes and direct mode call
						if !e.Mapped() {
							b.Fatalf("Mapping(%s) = %+v", f.Device(), e)
						}
						buf = c.lay.AppendOut(buf[:0], &f, e.Values)
						for h := range c.lay.NumHeaders() { // as the lanes do
							if v, ok := c.lay.HeaderString(h, e.Values); ok {
								hdr[h] = v
								continue
							}
							from := len(buf)
							buf = c.lay.AppendHeader(buf, h, &f, e.Values)
							hdr[h] = unsafe.String(&buf[from], len(buf)-from)
						}
						// The next message waits for this one (Revision>>63 is 0, but the CPU cannot know): in a
						// replica each message comes after much other work, so that the misses of two lookups never
						// overlap as they would in a bare loop.
						if i += 1 + int(e.Revision>>63); i == len(order) {
							i = 0
						}
					}
					runtime.KeepAlive(hdr)
				})
			}
		})
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
	ids := deviceIDs(benchDevices())
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
		if tb.Len() != benchDevices() {
			b.Errorf("Len() = %d, want %d", tb.Len(), benchDevices())
		}
		cancel()
		if err := <-done; err != nil {
			b.Errorf("Run() = %v", err)
		}
	}
}
