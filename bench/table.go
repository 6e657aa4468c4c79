package bench

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/kv"
)

// TableResult is the groups table at scale: a bucket of Devices keys loaded by package kv.
type TableResult struct {
	Devices int `json:"devices"`
	// LoadMsgsPerSec is how fast the bench put the keys into the bucket.
	LoadMsgsPerSec float64 `json:"load_msgs_per_s"`
	// Ready is the time from starting the table to its Ready channel closing.
	Ready Seconds `json:"ready_s"`
	// BytesPerDevice is the live heap the loaded table holds (after GC), per device.
	BytesPerDevice float64 `json:"bytes_per_device"`
	// LookupNs is the mean time of one Lookup, on one goroutine, cycling through every device.
	LookupNs float64 `json:"lookup_ns"`
	// LookupAllocs is the heap allocations per Lookup.
	LookupAllocs float64 `json:"lookup_allocs"`
}

const tableBucket = bucketPrefix + "table"

func (e *env) table(ctx context.Context) (*TableResult, error) {
	n := e.cfg.TableDevices
	res := &TableResult{Devices: n}
	if err := e.deleteStream(ctx, "KV_"+tableBucket); err != nil {
		return nil, err
	}
	bucket, err := e.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: tableBucket, History: 1, Storage: jetstream.FileStorage})
	if err != nil {
		return nil, fmt.Errorf("creating bucket %s: %w", tableBucket, err)
	}
	ids := make([]string, n)
	width := len(fmt.Sprint(n - 1))
	for i := range ids {
		ids[i] = fmt.Sprintf("tdev-%0*d", width, i)
	}
	start := time.Now()
	if err := e.putKeys(ctx, tableBucket, n, func(i int) (string, string) { return ids[i], fmt.Sprintf("grp-%d", i%100) }); err != nil {
		return nil, err
	}
	res.LoadMsgsPerSec = float64(n) / time.Since(start).Seconds()

	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	tb, err := kv.New(bucket, kv.Config{Logger: e.log})
	if err != nil {
		return nil, err
	}
	tctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	start = time.Now()
	go func() { done <- tb.Run(tctx) }()
	stopTable := func() error {
		stop()
		return <-done
	}
	e.prog.show("table: loading %d devices", n)
	select {
	case <-tb.Ready():
	case err := <-done:
		stop()
		return nil, fmt.Errorf("table stopped before it was ready: %v", err)
	case <-ctx.Done():
		_ = stopTable()
		return nil, ctx.Err()
	}
	res.Ready = secs(time.Since(start))
	runtime.GC()
	runtime.ReadMemStats(&m1)
	res.BytesPerDevice = (float64(m1.HeapAlloc) - float64(m0.HeapAlloc)) / float64(n)
	if got := tb.Len(); got != n {
		_ = stopTable()
		return nil, fmt.Errorf("table holds %d devices, want %d", got, n)
	}

	e.prog.show("table: timing lookups")
	lookups := max(n, 2_000_000)
	runtime.ReadMemStats(&m0)
	start = time.Now()
	misses := 0
	for i, j := 0, 0; i < lookups; i++ {
		if _, ok := tb.Lookup(ids[j]); !ok {
			misses++
		}
		if j++; j == n {
			j = 0
		}
	}
	el := time.Since(start)
	runtime.ReadMemStats(&m1)
	res.LookupNs = float64(el.Nanoseconds()) / float64(lookups)
	res.LookupAllocs = float64(m1.Mallocs-m0.Mallocs) / float64(lookups)
	runtime.KeepAlive(tb)
	if err := stopTable(); err != nil {
		return nil, err
	}
	if misses > 0 {
		return nil, fmt.Errorf("%d of %d lookups found no device", misses, lookups)
	}
	return res, e.deleteStream(ctx, "KV_"+tableBucket)
}
