package lanes_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/lanes"
)

// BenchmarkPipelineParkingOn is BenchmarkPipeline with --on-unmapped park and nothing parked: the
// cost parking adds to the hot path (a nil check and an empty map's length per message).
//
//	go test -run '^$' -bench 'Pipeline' -benchtime 200000x ./lanes/
func BenchmarkPipelineParkingOn(b *testing.B) {
	f := newFixture(b)
	cfg := f.parkOn(lanes.Config{}, 0, 0)
	devs := devices(1000)
	for i, d := range devs {
		f.groups.set(d, fmt.Sprintf("g%d", i%10))
	}
	f.store(b, devs, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	pool, stop := f.run(cfg, nil)
	f.waitFor(b, "OUTGOING", b.N)
	el := time.Since(start)
	b.StopTimer()
	stop()
	b.ReportMetric(float64(b.N)/el.Seconds(), "msgs/s")
	b.ReportMetric(float64(pool.Stats().Mapped), "mapped")
}

// BenchmarkParkAndRelease parks b.N messages of 100 devices without a group (timed: parking), then
// gives every device a group (timed: the release into OUTGOING, drains of four devices at a time
// per partition).
//
//	go test -run '^$' -bench ParkAndRelease -benchtime 100000x ./lanes/
func BenchmarkParkAndRelease(b *testing.B) {
	f := newFixture(b)
	cfg := f.parkOn(lanes.Config{}, int64(b.N), int64(b.N))
	devs := devices(100)
	f.store(b, devs, b.N)
	b.ResetTimer()
	start := time.Now()
	pool, stop := f.run(cfg, nil)
	f.waitFor(b, "PARKED", b.N)
	parked := time.Since(start)
	start = time.Now()
	for _, d := range devs {
		f.groups.set(d, "g")
		pool.Release(d)
	}
	f.waitFor(b, "OUTGOING", b.N)
	released := time.Since(start)
	b.StopTimer()
	stop()
	b.ReportMetric(float64(b.N)/parked.Seconds(), "parked/s")
	b.ReportMetric(float64(b.N)/released.Seconds(), "released/s")
}

// store publishes n messages of 128 bytes, devices in turns, into INCOMING.
func (f *fixture) store(b *testing.B, devs []string, n int) {
	payload := make([]byte, 128)
	for i := 0; i < n; i++ {
		if _, err := f.js.PublishAsync("incoming."+devs[i%len(devs)]+".evt", payload); err != nil {
			b.Fatal(err)
		}
		if i%4000 == 3999 {
			<-f.js.PublishAsyncComplete()
		}
	}
	<-f.js.PublishAsyncComplete()
}

// waitFor polls stream until it holds n messages.
func (f *fixture) waitFor(b *testing.B, stream string, n int) {
	ctx := context.Background()
	s, err := f.js.Stream(ctx, stream)
	if err != nil {
		b.Fatal(err)
	}
	for {
		// The purges that end a mass release hold the stream for seconds: wait for them.
		ictx, cancel := context.WithTimeout(ctx, time.Minute)
		info, err := s.Info(ictx)
		cancel()
		if err != nil {
			b.Fatal(err)
		}
		if info.State.Msgs >= uint64(n) {
			return
		}
		timer := time.NewTimer(5 * time.Millisecond)
		<-timer.C
	}
}
