package subjects_test

import (
	"errors"
	"slices"
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

func TestStreamLayout(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want subjects.StreamLayout
		ok   bool
	}{
		{"", subjects.SingleStream, true},
		{"single", subjects.SingleStream, true},
		{"streams", subjects.PartitionStreams, true},
		{"stream", "", false},
		{"Streams", "", false},
	} {
		got, err := subjects.ParseStreamLayout(tc.in)
		if got != tc.want || (err == nil) != tc.ok {
			t.Errorf("ParseStreamLayout(%q) = %q, %v; want %q, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
		if err != nil && !errors.Is(err, subjects.ErrInvalidLayout) {
			t.Errorf("ParseStreamLayout(%q) error %v does not wrap ErrInvalidLayout", tc.in, err)
		}
	}
}

func TestIncomingStreams(t *testing.T) {
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 4)
	if err != nil {
		t.Fatal(err)
	}
	single := subjects.Names{Incoming: "IN"}.WithDefaults()
	if s, f := single.IncomingStream(lay, 3); s != "IN" || f != "incoming.3.>" {
		t.Errorf("single: IncomingStream(3) = %q, %q; want IN, incoming.3.>", s, f)
	}
	if got := single.IncomingStreams(4); !slices.Equal(got, []string{"IN"}) {
		t.Errorf("single: IncomingStreams(4) = %q, want [IN]", got)
	}
	streams := subjects.Names{Incoming: "IN", StreamLayout: subjects.PartitionStreams}.WithDefaults()
	if s, f := streams.IncomingStream(lay, 3); s != "IN-3" || f != "" {
		t.Errorf("streams: IncomingStream(3) = %q, %q; want IN-3, no filter", s, f)
	}
	if got := streams.IncomingStreams(4); !slices.Equal(got, []string{"IN-0", "IN-1", "IN-2", "IN-3"}) {
		t.Errorf("streams: IncomingStreams(4) = %q", got)
	}
	// The account mapping does on publish what INCOMING's transform does on ingest.
	if lay.MappingSource() != "incoming.*.*" || lay.MappingDest() != "incoming.{{partition(4,1)}}.{{wildcard(1)}}.{{wildcard(2)}}" {
		t.Errorf("mapping %q → %q", lay.MappingSource(), lay.MappingDest())
	}
}

func TestParkedSubjects(t *testing.T) {
	if got, want := subjects.ParkedSubject("parked", 7, "dev-42"), "parked.7.dev-42"; got != want {
		t.Errorf("ParkedSubject() = %q, want %q", got, want)
	}
	if got, want := subjects.ParkedFilter("kv.parked", 3), "kv.parked.3.>"; got != want {
		t.Errorf("ParkedFilter() = %q, want %q", got, want)
	}
	for _, tc := range []struct {
		prefix, subject string
		device          string
		p               int
		ok              bool
	}{
		{"parked", "parked.7.dev-42", "dev-42", 7, true},
		{"kv.parked", "kv.parked.0.d", "d", 0, true},
		{"parked", "parked.07.d", "", -1, false},
		{"parked", "parked.x.d", "", -1, false},
		{"parked", "parked.7", "", -1, false},
		{"parked", "parked.7.", "", -1, false},
		{"parked", "parked.7.a.b", "", -1, false},
		{"parked", "other.7.d", "", -1, false},
	} {
		d, p, ok := subjects.ParkedDevice(tc.prefix, tc.subject)
		if d != tc.device || p != tc.p || ok != tc.ok {
			t.Errorf("ParkedDevice(%q, %q) = %q, %d, %v; want %q, %d, %v", tc.prefix, tc.subject, d, p, ok, tc.device, tc.p, tc.ok)
		}
	}
}
