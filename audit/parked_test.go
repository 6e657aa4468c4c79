package audit_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// Messages held in PARKED are parked, not missing; one in PARKED and OUTGOING (released, not yet
// purged) is no duplicate.
func TestParkedAreNotMissing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	if _, err := setup.Ensure(ctx, e.js, setup.Config{Layout: e.lay, Names: e.names, Park: &setup.ParkedStream{}}); err != nil {
		t.Fatal(err)
	}
	seqs := e.in("dev-1", "dev-2", "dev-2", "dev-3")
	e.out(put{seq: seqs[0], device: "dev-1"})
	e.out(put{seq: seqs[1], device: "dev-2"})
	// What a lane parks: dev-2's first message (since released), its second and dev-3's.
	for i, d := range map[int]string{1: "dev-2", 2: "dev-2", 3: "dev-3"} {
		m := nats.NewMsg(subjects.ParkedSubject("parked", subjects.Partition(d, 16), d))
		m.Header.Set(nats.MsgIdHdr, e.idPrefix()+strconv.FormatUint(seqs[i], 10))
		if _, err := e.js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	rep := e.run(audit.Config{})
	if !rep.OK() || rep.Missing != 0 || rep.Duplicates != 0 || rep.Parked != 2 {
		t.Errorf("Run() = %+v; want OK, 2 parked, none missing or duplicated", rep)
	}
	e.in("dev-4") // in no stream at all
	if rep := e.run(audit.Config{}); rep.OK() || rep.Missing != 1 || rep.Parked != 2 {
		t.Errorf("Run() = %+v; want 1 missing, 2 parked", rep)
	}
}
