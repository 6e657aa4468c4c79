package wire_test

import (
	"errors"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/wire"
)

// TestWireNames pins every name and value kvmapper writes where another process reads it: a
// replica of an older build, a verify, a dashboard or an alert reads these very bytes, so none of
// them may change by accident.
func TestWireNames(t *testing.T) {
	for _, tc := range []struct{ got, want string }{
		{wire.HeaderReason, "KVMapper-Reason"},
		{wire.HeaderError, "KVMapper-Error"},
		{wire.HeaderSubject, "KVMapper-Subject"},
		{wire.HeaderProvenance, "KVMapper-Prov"},
		{wire.HeaderPartition, "KVMapper-Partition"},
		{wire.HeaderEpoch, "KVMapper-Epoch"},
		{wire.HeaderRevision, "KVMapper-Revision"},
		{wire.HeaderOrigMsgID, "KVMapper-Orig-Msg-Id"},
		{wire.HeaderReplay, "KVMapper-Replay"},
		{wire.HeaderProbe, "KVMapper-Probe"},
		{wire.ProbeDevicePrefix, "kvmapper-probe-"},
		{wire.ReasonNoMapping, "no-mapping"},
		{wire.ReasonInvalidGroup, "invalid-group"},
		{wire.ReasonInvalidValue, "invalid-value"},
		{wire.ReasonMissingField, "missing-field"},
		{wire.ReasonInvalidField, "invalid-field"},
		{wire.HeaderField, "KVMapper-Field"},
		{wire.ReasonMalformedSubject, "malformed-subject"},
		{wire.ReasonOversized, "oversized"},
		{wire.ReasonRejected, "rejected"},
		{wire.ReasonParkFull, "park-full"},
		{wire.ReasonParkExpired, "park-expired"},
		{wire.ReasonParkDropped, "park-dropped"},
		{wire.LeaseKey(3), "lease.3"},
		{wire.LeaseFilter, "lease.>"},
		{wire.MemberKey("r-1"), "member.r-1"},
		{wire.MemberFilter, "member.>"},
		{wire.CheckpointKey(15), "checkpoint.15"},
		{wire.ParkedKey, "parked"},
		{wire.LayoutKey, "layout"},
		{wire.ModeKey, "mode"},
		{wire.UnparkKey(5, "dev-1"), "unpark.5.dev-1"},
		{wire.UnparkFilter(5), "unpark.5.*"},
		{wire.ReplayKey("r1"), "replay.r1"},
		{string(wire.UnparkRelease), "release"},
		{string(wire.UnparkDrop), "drop"},
		{string(wire.ModeStream), "stream"},
		{string(wire.ModeDirect), "direct"},
		{string(wire.ReceiveMapping), "mapping"},
		{string(wire.ReceiveAll), "all"},
		{wire.MsgIDPrefix("INCOMING", "abc"), "INCOMING:abc:"},
		{wire.LegacyMsgIDPrefix("INCOMING"), "INCOMING:"},
		{wire.ReplayMsgIDPrefix("r1", "INCOMING-3", "abc"), "replay:r1:INCOMING-3:abc:"},
		{string(wire.AppendMsgID([]byte("x"), "INCOMING:abc:", 42)), "xINCOMING:abc:42"},
		{wire.Incarnation(time.Unix(0, 36*36+1)), "101"},
	} {
		if tc.got != tc.want {
			t.Errorf("got %q, want %q", tc.got, tc.want)
		}
	}
	if got, want := len(wire.Reasons), 11; got != want {
		t.Errorf("len(Reasons) = %d, want %d", got, want)
	}
	for _, r := range wire.Reasons {
		if r == wire.ReasonDropped {
			t.Errorf("Reasons holds %q, which is never on a message", r)
		}
	}
}

func TestControlKeys(t *testing.T) {
	for _, tc := range []struct {
		key  string
		kind string
		p    int
		id   string
		ok   bool
	}{
		{wire.LeaseKey(3), wire.KindLease, 3, "", true},
		{wire.CheckpointKey(15), wire.KindCheckpoint, 15, "", true},
		{wire.MemberKey("r-1"), wire.KindMember, -1, "r-1", true},
		{"lease.x", "", -1, "", false},
		{"lease.-1", "", -1, "", false},
		{"lease.03", "", -1, "", false},
		{"checkpoint.", "", -1, "", false},
		{"member.", "", -1, "", false},
		{"other.1", "", -1, "", false},
		{"lease", "", -1, "", false},
		{wire.UnparkKey(1, "d"), "", -1, "", false},
		{wire.ReplayKey("r1"), "", -1, "", false},
	} {
		kind, p, id, ok := wire.ParseControlKey(tc.key)
		if kind != tc.kind || p != tc.p || id != tc.id || ok != tc.ok {
			t.Errorf("ParseControlKey(%q) = %q, %d, %q, %v; want %q, %d, %q, %v", tc.key, kind, p, id, ok, tc.kind, tc.p, tc.id, tc.ok)
		}
	}
}

func TestParseUnparkAction(t *testing.T) {
	for v, want := range map[string]wire.UnparkAction{"drop": wire.UnparkDrop, " drop\n": wire.UnparkDrop, "release": wire.UnparkRelease,
		"": wire.UnparkRelease, "DROP": wire.UnparkRelease, "other": wire.UnparkRelease} {
		if got := wire.ParseUnparkAction([]byte(v)); got != want {
			t.Errorf("ParseUnparkAction(%q) = %q, want %q", v, got, want)
		}
	}
}

func TestParseCheckpoint(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want wire.Checkpoint
		ok   bool
	}{
		{"abc:12", wire.Checkpoint{Incarnation: "abc", Seq: 12}, true},
		{"abc:0", wire.Checkpoint{Incarnation: "abc"}, true},
		{"12", wire.Checkpoint{Seq: 12}, true}, // written before incarnations
		{":12", wire.Checkpoint{}, false},
		{"abc:", wire.Checkpoint{}, false},
		{"abc:x", wire.Checkpoint{}, false},
		{"abc:-1", wire.Checkpoint{}, false},
		{"", wire.Checkpoint{}, false},
	} {
		got, err := wire.ParseCheckpoint([]byte(tc.in))
		if got != tc.want || (err == nil) != tc.ok {
			t.Errorf("ParseCheckpoint(%q) = %+v, %v; want %+v, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
		if err != nil && !errors.Is(err, wire.ErrInvalid) {
			t.Errorf("ParseCheckpoint(%q) = %v, want an error wrapping ErrInvalid", tc.in, err)
		}
	}
	if got, want := (wire.Checkpoint{Incarnation: "abc", Seq: 7}).String(), "abc:7"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got, want := (wire.Checkpoint{Seq: 7}).String(), "7"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

func FuzzParseCheckpoint(f *testing.F) {
	for _, s := range []string{"abc:12", "12", ":1", "a:b:3", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cp, err := wire.ParseCheckpoint([]byte(s))
		if err != nil {
			return
		}
		again, err := wire.ParseCheckpoint(cp.Append(nil))
		if err != nil || again != cp {
			t.Fatalf("ParseCheckpoint(%q) = %+v; its String %q reads back as %+v, %v", s, cp, cp.String(), again, err)
		}
	})
}

func TestParseMsgID(t *testing.T) {
	const prefix = "INCOMING:abc:"
	for _, tc := range []struct {
		id   string
		want uint64
		ok   bool
	}{
		{"INCOMING:abc:1", 1, true},
		{"INCOMING:abc:18446744073709551615", 1<<64 - 1, true},
		{"INCOMING:abc:0", 0, false},
		{"INCOMING:abc:", 0, false},
		{"INCOMING:abc:+1", 0, false},
		{"INCOMING:abc:1x", 0, false},
		{"INCOMING:abc:18446744073709551616", 0, false},
		{"INCOMING:xyz:1", 0, false},
		{"", 0, false},
	} {
		got, ok := wire.ParseMsgID(tc.id, prefix)
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseMsgID(%q) = %d, %v; want %d, %v", tc.id, got, ok, tc.want, tc.ok)
		}
	}
	if n := testing.AllocsPerRun(100, func() { wire.ParseMsgID("INCOMING:abc:123456", prefix) }); n != 0 {
		t.Errorf("ParseMsgID allocates %v times, want 0", n)
	}
}

func FuzzParseMsgID(f *testing.F) {
	f.Add("INCOMING", "abc", uint64(1))
	f.Add("IN:CO:MING", "", uint64(1<<63))
	f.Fuzz(func(t *testing.T, stream, inc string, seq uint64) {
		prefix := wire.MsgIDPrefix(stream, inc)
		id := string(wire.AppendMsgID(nil, prefix, seq))
		got, ok := wire.ParseMsgID(id, prefix)
		if ok != (seq > 0) || ok && got != seq {
			t.Fatalf("ParseMsgID(%q) = %d, %v; want %d", id, got, ok, seq)
		}
	})
}

func TestParseModeAndReceive(t *testing.T) {
	for in, want := range map[string]wire.Mode{"": wire.ModeStream, "stream": wire.ModeStream, "direct": wire.ModeDirect} {
		if got, err := wire.ParseMode(in); got != want || err != nil {
			t.Errorf("ParseMode(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := wire.ParseMode("Direct"); !errors.Is(err, wire.ErrInvalid) {
		t.Errorf("ParseMode(Direct) = %v, want an error wrapping ErrInvalid", err)
	}
	for in, want := range map[string]wire.Receive{"": wire.ReceiveMapping, "mapping": wire.ReceiveMapping, "all": wire.ReceiveAll} {
		if got, err := wire.ParseReceive(in); got != want || err != nil {
			t.Errorf("ParseReceive(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := wire.ParseReceive("any"); !errors.Is(err, wire.ErrInvalid) {
		t.Errorf("ParseReceive(any) = %v, want an error wrapping ErrInvalid", err)
	}
	if !wire.MarksDirect([]byte("direct")) || wire.MarksDirect([]byte("stream")) || wire.MarksDirect(nil) {
		t.Error("MarksDirect: only \"direct\" marks direct mode")
	}
}

func TestMemberValue(t *testing.T) {
	at := time.Unix(1_700_000_000, 123_456_789)
	for _, tc := range []struct {
		name  string
		value []byte
		id    string
		heard time.Time
	}{
		{"with the time heard", wire.MemberValue("r-1", at), "r-1", at},
		{"nothing heard yet", wire.MemberValue("r-1", time.Time{}), "r-1", time.Time{}},
		{"an older replica's bare id", []byte("r-1"), "r-1", time.Time{}},
		{"a second line that is no time", []byte("r-1\nsoon"), "r-1", time.Time{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, heard := wire.ParseMemberValue(tc.value)
			if id != tc.id || !heard.Equal(tc.heard) {
				t.Errorf("ParseMemberValue(%q) = %q, %v; want %q, %v", tc.value, id, heard, tc.id, tc.heard)
			}
		})
	}
}

// TestProvenance pins KVMapper-Prov's format, each field left out as it does not apply, and
// reads the three headers kvmapper wrote before it on messages stored then.
func TestProvenance(t *testing.T) {
	for _, tc := range []struct {
		p        int
		e, r     uint64
		want     string
		wantBack wire.Provenance
	}{
		{3, 17, 10007, "3.17.10007", wire.Provenance{Partition: 3, HasPartition: true, Epoch: 17, Revision: 10007}},
		{3, 17, 0, "3.17", wire.Provenance{Partition: 3, HasPartition: true, Epoch: 17}},     // a dead letter
		{0, 0, 42, "0..42", wire.Provenance{Partition: 0, HasPartition: true, Revision: 42}}, // a replayed message
		{15, 0, 0, "15", wire.Provenance{Partition: 15, HasPartition: true}},                 // a replayed dead letter
	} {
		if got := wire.ProvenanceValue(tc.p, tc.e, tc.r); got != tc.want {
			t.Errorf("ProvenanceValue(%d, %d, %d) = %q, want %q", tc.p, tc.e, tc.r, got, tc.want)
		}
		if got, ok := wire.ReadProvenance(headers{wire.HeaderProvenance: tc.want}.get); !ok || got != tc.wantBack {
			t.Errorf("ReadProvenance(%q) = %+v, %v, want %+v", tc.want, got, ok, tc.wantBack)
		}
	}
	for _, bad := range []string{"x", "3.x", "3.1.y", "-1.2.3", ""} {
		if pv, ok := wire.ParseProvenance(bad); ok {
			t.Errorf("ParseProvenance(%q) = %+v, want it refused", bad, pv)
		}
	}
	legacy := headers{wire.HeaderPartition: "3", wire.HeaderEpoch: "17", wire.HeaderRevision: "10007"}
	if got, ok := wire.ReadProvenance(legacy.get); !ok || got != (wire.Provenance{Partition: 3, HasPartition: true, Epoch: 17, Revision: 10007}) {
		t.Errorf("ReadProvenance(the three old headers) = %+v, %v", got, ok)
	}
	if _, ok := wire.ReadProvenance(headers{}.get); ok {
		t.Error("ReadProvenance(no headers) = true")
	}
	for name, want := range map[string]bool{"KVMapper-Prov": true, "kvmapper-prov": true, "KVMapper-Epoch": true, "KVMapper-Partition": true,
		"KVMapper-Revision": true, "KVMAPPER-REVISION": true, "KVMapper-Reason": false, "X-Trace": false, "KVMapper-Provenance": false, "": false} {
		if got := wire.IsProvenance(name); got != want {
			t.Errorf("IsProvenance(%q) = %v, want %v", name, got, want)
		}
	}
}

// headers is a message's headers, one value each, as nats.Header.Get reads them.
type headers map[string]string

func (h headers) get(k string) string { return h[k] }

func TestActsOnStream(t *testing.T) {
	for _, tc := range []struct {
		name string
		want bool
	}{
		{"Nats-Rollup", true}, {"nats-rollup", true}, {"Nats-Batch-Id", true}, {"Nats-Batch-Commit", true},
		{"Nats-Batch-Sequence", true}, {"Nats-Schedule", true}, {"Nats-Schedule-Target", true}, {"Nats-Incr", true},
		{"Nats-Msg-Id", false}, {"Nats-TTL", false}, {"Nats-Expected-Stream", false}, {"Nats-Rollups", false},
		{"KVMapper-Epoch", false}, {"Rollup", false}, {"", false},
	} {
		if got := wire.ActsOnStream(tc.name); got != tc.want {
			t.Errorf("ActsOnStream(%q) = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestChecked(t *testing.T) {
	v := wire.FormatChecked([]string{"OUTGOING", "UNMAPPED"})
	if v != "v1 OUTGOING,UNMAPPED" {
		t.Errorf("FormatChecked = %q, want v1 OUTGOING,UNMAPPED", v)
	}
	if got, ok := wire.ParseChecked(v); !ok || len(got) != 2 || got[0] != "OUTGOING" || got[1] != "UNMAPPED" {
		t.Errorf("ParseChecked(%q) = %v, %v", v, got, ok)
	}
	for _, bad := range []string{"", "v1 ", "v2 OUTGOING", "OUTGOING"} {
		if got, ok := wire.ParseChecked(bad); ok {
			t.Errorf("ParseChecked(%q) = %v, true; want false", bad, got)
		}
	}
}
