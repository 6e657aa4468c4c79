package fiprobe_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// BenchmarkOrderedRead reads b.N stored messages with an unfiltered ordered consumer, through
// Messages().Next() (what lanes does) or a Consume callback, to show what each costs in this
// process per message: allocations are the point, the server being in the same process (its
// allocations are in the figure too; the difference between the two is the client's).
//
//	go test -run '^$' -bench OrderedRead -benchtime 100000x -benchmem ./internal/fiprobe/
func BenchmarkOrderedRead(b *testing.B) {
	for _, how := range []string{"next", "consume"} {
		b.Run(how, func(b *testing.B) {
			s := natstest.Start(b)
			_, js := s.JetStream(b)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "IN", Subjects: []string{"in.>"}, Storage: jetstream.FileStorage})
			if err != nil {
				b.Fatal(err)
			}
			payload := make([]byte, 128)
			for i := range b.N {
				if _, err := js.PublishAsync("in.dev-"+strconv.Itoa(i%1000)+".t", payload); err != nil {
					b.Fatal(err)
				}
			}
			<-js.PublishAsyncComplete()
			if info, err := st.Info(ctx); err != nil || info.State.Msgs != uint64(b.N) {
				b.Fatalf("stream holds %v (%v), want %d", info, err, b.N)
			}
			cons, err := js.OrderedConsumer(ctx, "IN", jetstream.OrderedConsumerConfig{})
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			switch how {
			case "next":
				it, err := cons.Messages(jetstream.PullMaxMessages(512), jetstream.PullHeartbeat(time.Second))
				if err != nil {
					b.Fatal(err)
				}
				for range b.N {
					if _, err := it.Next(); err != nil {
						b.Fatal(err)
					}
				}
				it.Stop()
			case "consume":
				done := make(chan struct{})
				n := 0
				cc, err := cons.Consume(func(jetstream.Msg) {
					if n++; n == b.N {
						close(done)
					}
				}, jetstream.PullMaxMessages(512), jetstream.PullHeartbeat(time.Second))
				if err != nil {
					b.Fatal(err)
				}
				<-done
				cc.Stop()
				<-cc.Closed()
			}
			b.StopTimer()
		})
	}
}
