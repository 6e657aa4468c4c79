package audit_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/subjects"
)

// The report verify prints: OK in one line; FAILED with a count per kind and the examples; as
// JSON with ok, the rate and an empty list of findings rather than null.
func TestReportRenders(t *testing.T) {
	t.Parallel()
	names := subjects.DefaultNames
	ok := &audit.Report{Incoming: 10, IncomingFirst: 1, IncomingLast: 10, Outgoing: 9, Unmapped: 1, Devices: 1, Elapsed: time.Second}
	var b bytes.Buffer
	if err := ok.WriteText(&b, names); err != nil {
		t.Fatal(err)
	}
	if want := "OK: all 10 INCOMING messages (seq 1..10) are in OUTGOING (9) or UNMAPPED (1), once each; 1 device, each in order; no stale epoch; read 10 messages in 1s (10 msgs/s).\n"; b.String() != want {
		t.Errorf("WriteText() =\n%q, want\n%q", b.String(), want)
	}
	bad := &audit.Report{Incoming: 10, IncomingFirst: 1, IncomingLast: 10, Outgoing: 8, Unmapped: 1, Devices: 2, Missing: 1, Elapsed: time.Second,
		Findings: []audit.Finding{{Kind: audit.KindMissing, Seq: 4, Stream: "INCOMING", StreamSeq: 4, Detail: "in neither output"}}}
	b.Reset()
	if err := bad.WriteText(&b, names); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"FAILED: INCOMING seq 1..10 (10 messages) against OUTGOING (8 read) and UNMAPPED (1 read), 2 devices;",
		"\n  missing      1\n", "\n  duplicate    0\n", "examples:\n  missing      INCOMING #4 device -: in neither output\n"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("WriteText() =\n%s\nwant it to hold %q", b.String(), want)
		}
	}
	b.Reset()
	if err := ok.WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	var got struct {
		OK         bool              `json:"ok"`
		MsgsPerSec float64           `json:"msgs_per_sec"`
		Findings   []json.RawMessage `json:"findings"`
		Outgoing   uint64            `json:"outgoing"`
	}
	if err := json.Unmarshal(b.Bytes(), &got); err != nil || !got.OK || got.MsgsPerSec != 10 || got.Findings == nil || got.Outgoing != 9 {
		t.Errorf("WriteJSON() = %s (%v), want ok, 10 msgs/s, findings [] and outgoing 9", b.String(), err)
	}
}
