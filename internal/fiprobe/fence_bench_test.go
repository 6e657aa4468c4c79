package fiprobe_test

import (
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// BenchmarkR3Writes compares, on an in-process 3-node cluster with OUTGOING at R3, the write
// paths an output-side fence could ride on (docs/design-fencing.md): 16 lanes on one connection,
// each writing its own device, (a) async single publishes with up to 256 in flight per lane,
// unfenced (the lanes' write path today), and (b) atomic batches of n messages, the first
// checking the lane's fence subject, one batch in flight per lane (the most a fence allows on
// R3: TestFenceCheckPerMessage). 128-byte payloads.
//
//	go test -run '^$' -bench BenchmarkR3Writes -benchtime 40000x ./internal/fiprobe/
func BenchmarkR3Writes(b *testing.B) {
	c := natstest.StartCluster(b, 3)
	nc := c.Connect(b, 0)
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	createOutgoing(b, js, 3, func(cfg *jetstream.StreamConfig) {
		cfg.Subjects = append(cfg.Subjects, "kvmapper.fence.>")
		cfg.AllowAtomicPublish = true
	})
	c.WaitStreamCurrent("OUTGOING", 30*time.Second)
	const lanes = 16
	payload := make([]byte, 128)
	run := 0
	bench := func(name string, lane func(b *testing.B, l, n int, prefix string)) {
		b.Run(name, func(b *testing.B) {
			run++
			prefix := strconv.Itoa(run) + "-"
			per := max(1, b.N/lanes)
			b.ResetTimer()
			start := time.Now()
			var wg sync.WaitGroup
			for l := range lanes {
				wg.Go(func() { lane(b, l, per, prefix) })
			}
			wg.Wait()
			b.ReportMetric(float64(per*lanes)/time.Since(start).Seconds(), "msgs/s")
		})
	}
	newMsg := func(l, i int, prefix string) *nats.Msg {
		m := nats.NewMsg("outgoing.g.d" + strconv.Itoa(l) + ".t")
		m.Data = payload
		m.Header.Set(nats.MsgIdHdr, prefix+strconv.Itoa(l)+":"+strconv.Itoa(i))
		return m
	}
	bench("async", func(b *testing.B, l, n int, prefix string) {
		inbox := nc.NewInbox()
		acks := make(chan *nats.Msg, 1024)
		sub, err := nc.ChanSubscribe(inbox+".*", acks)
		if err != nil {
			b.Error(err)
			return
		}
		defer func() { _ = sub.Unsubscribe() }()
		inFlight, sent := 0, 0
		for done := 0; done < n; {
			for inFlight < 256 && sent < n {
				m := newMsg(l, sent, prefix)
				m.Reply = inbox + "." + strconv.Itoa(sent)
				if err := nc.PublishMsg(m); err != nil {
					b.Error(err)
					return
				}
				sent++
				inFlight++
			}
			select {
			case <-acks:
				inFlight--
				done++
			case <-time.After(wait):
				b.Errorf("lane %d: no acknowledgement within %v", l, wait)
				return
			}
		}
	})
	for _, size := range []int{16, 64, 256} {
		bench("atomic-fenced-"+strconv.Itoa(size), func(b *testing.B, l, n int, prefix string) {
			inbox := nc.NewInbox()
			acks := make(chan *nats.Msg, 4)
			sub, err := nc.ChanSubscribe(inbox, acks)
			if err != nil {
				b.Error(err)
				return
			}
			defer func() { _ = sub.Unsubscribe() }()
			fence := "kvmapper.fence." + prefix + strconv.Itoa(l)
			var fseq uint64 // 0: no message on the fence subject yet
			for i, id := 0, 0; i < n; id++ {
				k := min(size, n-i)
				bid := prefix + strconv.Itoa(l) + "-" + strconv.Itoa(id)
				for j := range k {
					m := newMsg(l, i+j, prefix)
					m.Header.Set("Nats-Batch-Id", bid)
					m.Header.Set("Nats-Batch-Sequence", strconv.Itoa(j+1))
					if j == 0 {
						m.Header.Set(hdrExpectSeq, strconv.FormatUint(fseq, 10))
						m.Header.Set(hdrExpectSubj, fence)
					}
					if j == k-1 {
						m.Header.Set("Nats-Batch-Commit", "1")
						m.Reply = inbox
					}
					if err := nc.PublishMsg(m); err != nil {
						b.Error(err)
						return
					}
				}
				select {
				case a := <-acks:
					if len(a.Data) == 0 || a.Data[2] == 'e' { // {"error":…
						b.Errorf("lane %d batch %d: %s", l, id, a.Data)
						return
					}
				case <-time.After(wait):
					b.Errorf("lane %d: no commit answer within %v", l, wait)
					return
				}
				i += k
			}
		})
	}
}
