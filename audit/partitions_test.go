package audit_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/subjects"
)

// In the partition-streams layout every partition stream numbers its messages from 1: the audit
// tells INCOMING-3:1 from INCOMING-5:1 by the stream the Nats-Msg-Id names, and reports each
// range, gap and duplicate against its own stream.
func TestPartitionStreamsAudit(t *testing.T) {
	t.Parallel()
	e := newEnvIn(t, subjects.PartitionStreams)
	// Four devices in four partitions: each partition stream holds sequences 1..3 of one device.
	var devs []string
	parts := map[int]bool{}
	for i := 0; len(devs) < 4; i++ {
		d := fmt.Sprintf("dev-%d", i)
		if p := subjects.Partition(d, 16); !parts[p] {
			parts[p] = true
			devs = append(devs, d)
		}
	}
	for range 3 {
		for i, seq := range e.in(devs...) {
			e.out(put{seq: seq, device: devs[i], epoch: 5})
		}
	}
	rep := e.run(audit.Config{})
	check(t, rep, counts{Incoming: 12, Outgoing: 12, Devices: 4}, true, nil)
	if len(rep.Ranges) != 16 || rep.IncomingFirst != 0 || rep.IncomingLast != 0 {
		t.Fatalf("Run() ranges %+v, first %d, last %d: want 16 ranges, one per partition stream, and no single range",
			rep.Ranges, rep.IncomingFirst, rep.IncomingLast)
	}
	for p, r := range rep.Ranges {
		want := audit.Range{Stream: fmt.Sprintf("INCOMING-%d", p)}
		if parts[p] {
			want.First, want.Last, want.Count = 1, 3, 3
		}
		if r != want {
			t.Errorf("Ranges[%d] = %+v, want %+v", p, r, want)
		}
	}

	// One of each problem, each in its own partition stream.
	p0, p1, p2 := subjects.Partition(devs[0], 16), subjects.Partition(devs[1], 16), subjects.Partition(devs[2], 16)
	e.out(put{seq: 2, device: devs[0], unmapped: true}) // a second copy of INCOMING-p0:2
	s := e.in(devs[1], devs[1])                         // INCOMING-p1:4 and :5, stored out of order
	e.out(put{seq: s[1], device: devs[1]})
	e.out(put{seq: s[0], device: devs[1]})
	e.in(devs[2]) // INCOMING-p2:4, never mapped
	e.out(put{seq: 1, device: devs[3], id: fmt.Sprintf("INCOMING-%d:0000:1", subjects.Partition(devs[3], 16))})
	rep = e.run(audit.Config{})
	check(t, rep, counts{Incoming: 15, Outgoing: 15, Unmapped: 1, Devices: 4, Duplicates: 1, Reorders: 1, Missing: 1, Foreign: 1}, false, rep.Findings)
	byKind := map[string]audit.Finding{}
	for _, f := range rep.Findings {
		byKind[f.Kind] = f
	}
	for kind, want := range map[string]struct {
		stream string
		seq    uint64
		detail string
	}{
		audit.KindMissing:   {fmt.Sprintf("INCOMING-%d", p2), 4, fmt.Sprintf("INCOMING-%d:4 is in neither", p2)},
		audit.KindDuplicate: {"UNMAPPED", 2, fmt.Sprintf("INCOMING-%d:2 stored again", p0)},
		audit.KindReorder:   {"OUTGOING", 4, fmt.Sprintf("INCOMING-%d:4 stored after INCOMING-%d:5", p1, p1)},
		audit.KindForeign:   {"OUTGOING", 0, "names no partition stream's current incarnation"},
	} {
		f := byKind[kind]
		if f.Stream != want.stream || f.Seq != want.seq || !strings.Contains(f.Detail, want.detail) {
			t.Errorf("%s finding %+v, want stream %s, seq %d, detail with %q", kind, f, want.stream, want.seq, want.detail)
		}
	}
}
