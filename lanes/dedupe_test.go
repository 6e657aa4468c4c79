package lanes_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
)

// A message OUTGOING already holds (the same Nats-Msg-Id, as after a takeover) is counted as a
// duplicate, not as mapped: the counters that tests and operators read for "nothing sent twice"
// depend on it.
func TestDuplicatesAreCounted(t *testing.T) {
	f := newFixture(t)
	devs := devices(10)
	for _, d := range devs {
		f.groups.set(d, "g")
	}
	f.publish(devs, 10, nil)
	// Store INCOMING sequences 1..5 in OUTGOING beforehand, as a dead owner would have.
	in := f.read("INCOMING", 100)
	for i := range 5 {
		m := in[i]
		dev := string(m.Data()[:len("dev-000")])
		out := &nats.Msg{Subject: "outgoing.g." + dev + ".evt", Data: m.Data(), Header: nats.Header{}}
		out.Header.Set(nats.MsgIdHdr, f.msgID(uint64(i+1)))
		if _, err := f.js.PublishMsg(context.Background(), out); err != nil {
			t.Fatalf("PublishMsg: %v", err)
		}
	}
	pool, _ := f.run(lanes.Config{}, nil)
	checkOrder(t, f.read("OUTGOING", 100), devs, 10, func(d string) string { return "outgoing.g." + d + ".evt" })
	natstest.Eventually(t, 30*time.Second, func() error {
		if st := pool.Stats(); st.Duplicates != 5 || st.Mapped != 95 {
			return fmt.Errorf("Stats() = %d mapped, %d duplicates; want 95 and 5", st.Mapped, st.Duplicates)
		}
		return nil
	})
}
