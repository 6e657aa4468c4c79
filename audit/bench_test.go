package audit_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// BenchmarkRun1M audits 1M (or $AUDIT_BENCH_N) INCOMING messages from 10k devices, mapped 90% to OUTGOING and 10% to
// UNMAPPED with provenance headers and 128-byte payloads, as a lane writes them. Setup (2M
// publishes) takes a while; run it alone:
//
//	go test -run '^$' -bench Run1M -benchtime 3x ./audit/
func BenchmarkRun1M(b *testing.B) {
	const devices = 10_000
	n := 1_000_000
	if testing.Short() {
		n = 100_000 // CI runs every benchmark once with -short: to run, not to measure
	}
	if v, err := strconv.Atoi(os.Getenv("AUDIT_BENCH_N")); err == nil && v > 0 {
		n = v // for quicker experiments
	}
	e := newEnv(b)
	ctx := context.Background()
	_, js := e.srv.JetStream(b)
	js, err := jetstream.New(js.Conn(), jetstream.WithPublishAsyncMaxPending(8192))
	if err != nil {
		b.Fatalf("jetstream.New: %v", err)
	}
	payload := make([]byte, 128)
	devs := make([]string, devices)
	for i := range devs {
		devs[i] = fmt.Sprintf("dev-%d", i)
	}
	fill := func(what string, msg func(i int) *nats.Msg) {
		for i := range n {
			if _, err := js.PublishMsgAsync(msg(i), jetstream.WithStallWait(30*time.Second)); err != nil {
				b.Fatalf("PublishMsgAsync(%s %d): %v", what, i, err)
			}
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(time.Minute):
			b.Fatalf("publishing %s did not complete within a minute", what)
		}
	}
	start := time.Now()
	fill("INCOMING", func(i int) *nats.Msg {
		return &nats.Msg{Subject: "incoming." + devs[i%devices] + ".temp", Data: payload}
	})
	epochs := make([]string, e.lay.Partitions)
	for p := range epochs {
		epochs[p] = strconv.Itoa(100 + p)
	}
	fill("outputs", func(i int) *nats.Msg {
		d := devs[i%devices]
		p := subjects.Partition(d, e.lay.Partitions)
		m := &nats.Msg{Subject: "outgoing.g1." + d + ".temp", Data: payload, Header: nats.Header{
			nats.MsgIdHdr:         {"INCOMING:" + strconv.Itoa(i+1)},
			wire.HeaderProvenance: {strconv.Itoa(p) + "." + epochs[p] + ".7"},
		}}
		if i%10 == 9 {
			m.Subject = "unmapped." + d + ".temp"
			m.Header[wire.HeaderReason] = []string{wire.ReasonNoMapping}
		}
		return m
	})
	b.Logf("setup: 2x%d messages published in %v", n, time.Since(start).Round(time.Millisecond))

	b.ReportAllocs()
	b.ResetTimer()
	var rep *audit.Report
	for b.Loop() {
		rep, err = audit.Run(ctx, e.js, audit.Config{Layout: e.lay})
		if err != nil {
			b.Fatalf("Run: %v", err)
		}
		b.Logf("Run: %v", rep.Elapsed)
	}
	b.StopTimer()
	if !rep.OK() || rep.Incoming != uint64(n) || rep.Outgoing+rep.Unmapped != uint64(n) || rep.Devices != devices {
		b.Fatalf("Run() = %+v, want OK with %d messages and %d devices", rep, n, devices)
	}
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}
