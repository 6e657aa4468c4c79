package subjects_test

import (
	"testing"

	"github.com/kvmapper/kvmapper/subjects"
)

func TestNamesWithDefaults(t *testing.T) {
	if got := (subjects.Names{}).WithDefaults(); got != subjects.DefaultNames {
		t.Errorf("Names{}.WithDefaults() = %+v, want %+v", got, subjects.DefaultNames)
	}
	n := subjects.Names{Incoming: "IN", Control: "ctl"}.WithDefaults()
	if n.Incoming != "IN" || n.Control != "ctl" || n.Outgoing != "OUTGOING" || n.Groups != "device-groups" {
		t.Errorf("WithDefaults() = %+v: kept names must stay, empty ones get defaults", n)
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
		{subjects.LeaseKey(3), subjects.KindLease, 3, "", true},
		{subjects.CheckpointKey(15), subjects.KindCheckpoint, 15, "", true},
		{subjects.MemberKey("r-1"), subjects.KindMember, -1, "r-1", true},
		{"lease.x", "", -1, "", false},
		{"lease.-1", "", -1, "", false},
		{"lease.03", "", -1, "", false},
		{"checkpoint.", "", -1, "", false},
		{"member.", "", -1, "", false},
		{"other.1", "", -1, "", false},
		{"lease", "", -1, "", false},
	} {
		kind, p, id, ok := subjects.ParseControlKey(tc.key)
		if kind != tc.kind || p != tc.p || id != tc.id || ok != tc.ok {
			t.Errorf("ParseControlKey(%q) = %q, %d, %q, %v; want %q, %d, %q, %v", tc.key, kind, p, id, ok, tc.kind, tc.p, tc.id, tc.ok)
		}
	}
}
