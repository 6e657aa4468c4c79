package status_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/status"
)

// BenchmarkLag compares the two ways of counting a partition's lag from the stream alone, with
// 10k devices in INCOMING: Read's (an ephemeral consumer per partition starting after the
// checkpoint, reading its pending count) and a stream info with a subject filter (per-subject
// totals that cannot start after a checkpoint, and grow with the devices).
func BenchmarkLag(b *testing.B) {
	e := newEnv(b)
	ctx := context.Background()
	var futs []jetstream.PubAckFuture
	for d := range 10_000 {
		for range 5 {
			f, err := e.js.PublishAsync(fmt.Sprintf("incoming.dev-%05d.t", d), []byte("x"))
			if err != nil {
				b.Fatal(err)
			}
			futs = append(futs, f)
		}
	}
	for _, f := range futs {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			b.Fatal(err)
		}
	}
	lay := layout(b)
	b.Run("Read/consumer-pending", func(b *testing.B) {
		for b.Loop() {
			if _, err := status.Read(ctx, e.js, status.ReadConfig{Layout: lay}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("StreamInfo/subject-filter", func(b *testing.B) {
		s, err := e.js.Stream(ctx, "INCOMING")
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			for p := range partitions {
				if _, err := s.Info(ctx, jetstream.WithSubjectFilter(lay.Filter(p))); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
