package direct_test

import (
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/wire"
)

// BenchmarkPipeline measures the whole path of a message in direct mode, in process: a device
// publishes with a reply subject, keeping 1024 unacknowledged, the server delivers each message
// to its partition's owner, which republishes it to OUTGOING, whose PubAck goes back to the
// device. b.N messages over 64 devices of every partition; -cpuprofile shows where the client's
// time goes (the server's is in the same process).
//
//	go test -run '^$' -bench Pipeline -benchtime 200000x ./direct/
//
// The straight sub-benchmark publishes into OUTGOING itself, with no pool: the reference.
func BenchmarkPipeline(b *testing.B) {
	for _, name := range []string{"straight", "plain", "provenance"} {
		b.Run(name, func(b *testing.B) {
			f := newFixture(b, wire.ReceiveMapping)
			devs := make([]string, 64)
			for i := range devs {
				devs[i] = "dev-" + strconv.Itoa(i)
				f.groups.set(devs[i], "group-a")
			}
			prefix := "outgoing.group-a."
			if name != "straight" {
				p := f.pool("a", nil, func(c *direct.Config) { c.Provenance = name == "provenance" })
				f.runAll(p, 1)
				prefix = "incoming."
			}
			nc := f.srv.Connect(b)
			inbox := nc.NewInbox() + "."
			window := make(chan struct{}, 1024)
			done := make(chan struct{})
			var acked int
			sub, err := nc.Subscribe(inbox+"*", func(m *nats.Msg) {
				<-window
				acked++
				if acked == b.N {
					close(done)
				}
			})
			if err != nil {
				b.Fatal(err)
			}
			if err := sub.SetPendingLimits(-1, -1); err != nil {
				b.Fatal(err)
			}
			payload := make([]byte, 128)
			b.ResetTimer()
			start := time.Now()
			for i := range b.N {
				window <- struct{}{}
				if err := nc.PublishMsg(&nats.Msg{Subject: prefix + devs[i%len(devs)] + ".temp", Reply: inbox + strconv.Itoa(i), Data: payload}); err != nil {
					b.Fatal(err)
				}
			}
			<-done
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
		})
	}
}

// BenchmarkLatency publishes at 10,000 messages a second for b.N messages and reports the
// publish → PubAck latency, p50 and p99, straight into OUTGOING and through a pool.
//
//	go test -run '^$' -bench Latency -benchtime 30000x ./direct/
func BenchmarkLatency(b *testing.B) {
	for _, name := range []string{"straight", "plain"} {
		b.Run(name, func(b *testing.B) {
			f := newFixture(b, wire.ReceiveMapping)
			f.groups.set("dev-1", "group-a")
			subject := "outgoing.group-a.dev-1.temp"
			if name != "straight" {
				f.runAll(f.pool("a", nil, nil), 1)
				subject = "incoming.dev-1.temp"
			}
			nc := f.srv.Connect(b)
			inbox := nc.NewInbox() + "."
			sent := make([]time.Time, b.N)
			lat := make([]time.Duration, b.N)
			var mu sync.Mutex
			done := make(chan struct{})
			n := 0
			if _, err := nc.Subscribe(inbox+"*", func(m *nats.Msg) {
				now := time.Now()
				i, _ := strconv.Atoi(m.Subject[len(inbox):])
				mu.Lock()
				lat[i] = now.Sub(sent[i])
				n++
				if n == b.N {
					close(done)
				}
				mu.Unlock()
			}); err != nil {
				b.Fatal(err)
			}
			payload := make([]byte, 128)
			b.ResetTimer()
			start := time.Now()
			for i := range b.N {
				if d := time.Until(start.Add(time.Duration(i) * 100 * time.Microsecond)); d > 0 {
					time.Sleep(d) // pacing the publishes at 10k msgs/s, not a synchronisation
				}
				mu.Lock()
				sent[i] = time.Now()
				mu.Unlock()
				if err := nc.PublishMsg(&nats.Msg{Subject: subject, Reply: inbox + strconv.Itoa(i), Data: payload}); err != nil {
					b.Fatal(err)
				}
			}
			<-done
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
		})
	}
}
