package replay_test

import (
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/replay"
	"github.com/kvmapper/kvmapper/subjects"
)

func TestTemplates(t *testing.T) {
	live, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		into, out, dead   string
		wantOut, wantDead string
	}{
		{"REPLAY", "", "", "replay.{group}.{device}.{event}", "replay-unmapped.{device}.{event}"},
		{"OUTGOING", "", "", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}"},
		{"REPLAY", "again.{group}.{device}", "", "again.{group}.{device}", "again-unmapped.{device}.{event}"},
		{"REPLAY", "", "dl.{device}", "replay.{group}.{device}.{event}", "dl.{device}"},
	} {
		out, dead, err := replay.Templates(live, "OUTGOING", tc.into, tc.out, tc.dead)
		if err != nil || out != tc.wantOut || dead != tc.wantDead {
			t.Errorf("Templates(%q, %q, %q) = %q, %q, %v; want %q, %q", tc.into, tc.out, tc.dead, out, dead, err, tc.wantOut, tc.wantDead)
		}
	}
	if _, _, err := replay.Templates(live, "OUTGOING", "REPLAY", "bad..out", ""); err == nil {
		t.Error("Templates with out bad..out: no error")
	}
}

func TestParseWhenAndAsOf(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	for v, want := range map[string]time.Time{"2h": now.Add(-2 * time.Hour), "-2h": now.Add(-2 * time.Hour), "2026-11-30T10:00:00Z": time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)} {
		if got, err := replay.ParseWhen(v, now); err != nil || !got.Equal(want) {
			t.Errorf("ParseWhen(%q) = %v, %v; want %v", v, got, err, want)
		}
	}
	for v, want := range map[string]replay.AsOf{"now": {}, "": {}, "41": {Revision: 41}, "1h": {Time: now.Add(-time.Hour)}} {
		if got, err := replay.ParseAsOf(v, now); err != nil || got.Revision != want.Revision || !got.Time.Equal(want.Time) {
			t.Errorf("ParseAsOf(%q) = %+v, %v; want %+v", v, got, err, want)
		}
	}
	if _, err := replay.ParseAsOf("yesterday", now); err == nil {
		t.Error("ParseAsOf(yesterday): no error")
	}
}
