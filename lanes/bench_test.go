package lanes_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/lanes"
)

// BenchmarkPipeline measures the whole lane pipeline against an embedded server in this process:
// b.N messages from 1000 devices are stored in INCOMING first, then the timer runs until OUTGOING
// holds them all. `kvmapper bench` measures the same with the server in its own process.
//
//	go test -run '^$' -bench Pipeline -benchtime 200000x ./lanes/
func BenchmarkPipeline(b *testing.B) {
	f := newFixture(b)
	devs := devices(1000)
	for i, d := range devs {
		f.groups.set(d, fmt.Sprintf("g%d", i%10))
	}
	payload := make([]byte, 128)
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		if _, err := f.js.PublishAsync("incoming."+devs[i%len(devs)]+".evt", payload); err != nil {
			b.Fatal(err)
		}
		if i%4000 == 3999 {
			<-f.js.PublishAsyncComplete()
		}
	}
	<-f.js.PublishAsyncComplete()
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	pool, stop := f.run(lanes.Config{}, nil)
	out, err := f.js.Stream(ctx, "OUTGOING")
	if err != nil {
		b.Fatal(err)
	}
	for {
		info, err := out.Info(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if info.State.Msgs >= uint64(b.N) {
			break
		}
		timer := time.NewTimer(5 * time.Millisecond)
		<-timer.C
	}
	el := time.Since(start)
	b.StopTimer()
	stop()
	b.ReportMetric(float64(b.N)/el.Seconds(), "msgs/s")
	b.ReportMetric(float64(pool.Stats().Mapped), "mapped")
}
