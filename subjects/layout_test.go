package subjects_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/subjects"
)

const (
	defIn       = "incoming.{device}.{event}"
	defOut      = "outgoing.{group}.{device}.{event}"
	defUnmapped = "unmapped.{device}.{event}"
)

func defaultLayout(t testing.TB) *subjects.Layout {
	t.Helper()
	l, err := subjects.NewLayout(defIn, defOut, defUnmapped, 16)
	if err != nil {
		t.Fatalf("NewLayout() = %v", err)
	}
	return l
}

func TestNewLayout(t *testing.T) {
	tests := []struct {
		name              string
		in, out, unmapped string
		partitions        int
		why               string // substring of the error; "" means valid
	}{
		{"defaults", defIn, defOut, defUnmapped, 16, ""},
		{"one partition", defIn, defOut, defUnmapped, 1, ""},
		{"max partitions", defIn, defOut, defUnmapped, 1024, ""},
		{"device only", "in.{device}", "out.{group}.{device}", "dead.{device}", 4, ""},
		{"literal between", "a.b.{site}.x.{device}", "o.{group}.{device}.{site}.{device}", "u.{site}", 4, ""},
		{"unmapped without device", defIn, defOut, "unmapped.{event}", 16, ""},
		{"out prefix past in", "incoming.{device}.{event}", "incoming.a.b.c.{group}.{device}", "unmapped.{device}", 16, ""},

		{"bad in syntax", "incoming..{device}", defOut, defUnmapped, 16, "in template"},
		{"bad out syntax", defIn, "outgoing.{Group}", defUnmapped, 16, "out template"},
		{"bad unmapped syntax", defIn, defOut, "unmapped.*", 16, "unmapped template"},
		{"zero partitions", defIn, defOut, defUnmapped, 0, "0 partitions"},
		{"negative partitions", defIn, defOut, defUnmapped, -1, "-1 partitions"},
		{"too many partitions", defIn, defOut, defUnmapped, 1025, "between 1 and 1024"},
		{"in starts with placeholder", "{device}.{event}", defOut, defUnmapped, 16, "in \"{device}.{event}\" must start with a literal"},
		{"in without device", "incoming.{id}.{event}", defOut, defUnmapped, 16, "must contain {device}"},
		{"in with group", "incoming.{group}.{device}", defOut, defUnmapped, 16, "may not contain {group}"},
		{"in with partition", "incoming.{partition}.{device}", defOut, defUnmapped, 16, "may not contain {partition}"},
		{"in device twice", "incoming.{device}.{device}", "outgoing.{group}.{device}", defUnmapped, 16, "{device} 2 times"},
		{"in event twice", "incoming.{device}.{event}.{event}", defOut, defUnmapped, 16, "{event} 2 times"},
		{"in too many placeholders", "i.{device}.{a}.{b}.{c}.{d}.{e}.{f}.{g}.{h}", defOut, "u.{device}", 16, "9 placeholders"},
		{"out starts with placeholder", defIn, "{group}.{device}.{event}", defUnmapped, 16, "out \"{group}.{device}.{event}\" must start with a literal"},
		{"out without group", defIn, "outgoing.{device}.{event}", defUnmapped, 16, ""},
		{"out with value fields", defIn, "outgoing.{region}.{tenant}.{group}.{device}.{event}", defUnmapped, 16, ""},
		{"out without device", defIn, "outgoing.{group}.{event}", defUnmapped, 16, "must contain {device}"},
		{"out with partition", defIn, "outgoing.{group}.{partition}.{device}", defUnmapped, 16, "may not contain {partition}"},
		{"unmapped starts with placeholder", defIn, defOut, "{device}.{event}", 16, "unmapped \"{device}.{event}\" must start with a literal"},
		{"unmapped with group", defIn, defOut, "unmapped.{group}.{device}", 16, "may not contain {group}"},
		{"unmapped unknown placeholder", defIn, defOut, "unmapped.{kind}", 16, "uses {kind}"},
		{"unmapped without placeholder", defIn, defOut, "unmapped", 16, "has no placeholder"},
		{"out loops into in", defIn, "incoming.{group}.{device}.{event}", defUnmapped, 16, "would loop"},
		{"out loops into stored", defIn, "incoming.{group}.{device}", defUnmapped, 16, "would loop"},
		{"out literal loops into in", defIn, "incoming.x.{group}.{device}", defUnmapped, 16, "would loop"},
		{"unmapped loops into in", defIn, defOut, "incoming.{device}.{event}", 16, "would loop"},
		{"unmapped loops into stored", defIn, defOut, "incoming.dead.{device}", 16, "would loop"},
		{"out overlaps unmapped", defIn, "outgoing.{group}.{device}", "outgoing.{device}", 16, "overlaps unmapped"},
		{"out prefix inside unmapped", defIn, "dl.ok.{group}.{device}", "dl.{device}", 16, "overlaps unmapped"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := subjects.NewLayout(tt.in, tt.out, tt.unmapped, tt.partitions)
			if tt.why == "" {
				if err != nil {
					t.Fatalf("NewLayout() = %v, want nil", err)
				}
				if l.In.String() != tt.in || l.Out.String() != tt.out || l.Unmapped.String() != tt.unmapped || l.Partitions != tt.partitions {
					t.Fatalf("NewLayout() = %s %s %s %d, want the arguments back", l.In, l.Out, l.Unmapped, l.Partitions)
				}
				return
			}
			if !errors.Is(err, subjects.ErrInvalidTemplate) {
				t.Fatalf("NewLayout() = %v, want an error wrapping ErrInvalidTemplate", err)
			}
			if !strings.Contains(err.Error(), tt.why) {
				t.Fatalf("NewLayout() = %q, want it to say %q", err, tt.why)
			}
		})
	}
}

func TestLayoutSubjects(t *testing.T) {
	tests := []struct {
		name                         string
		in, out, unmapped            string
		partitions                   int
		stream, dest, filter3        string
		outStream, unmStream, malfrm string
	}{
		{
			"defaults", defIn, defOut, defUnmapped, 16,
			"incoming.*.*", "incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}", "incoming.3.>",
			"outgoing.>", "unmapped.>", "unmapped._malformed._malformed",
		},
		{
			"device second", "a.b.{site}.x.{device}", "o.p.{group}.{device}", "u.{device}.{site}", 8,
			"a.b.*.x.*", "a.b.{{partition(8,2)}}.{{wildcard(1)}}.x.{{wildcard(2)}}", "a.b.3.>",
			"o.p.>", "u.>", "u._malformed._malformed",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := subjects.NewLayout(tt.in, tt.out, tt.unmapped, tt.partitions)
			if err != nil {
				t.Fatalf("NewLayout() = %v", err)
			}
			for _, c := range []struct{ call, got, want string }{
				{"StreamSubject()", l.StreamSubject(), tt.stream},
				{"TransformSource()", l.TransformSource(), tt.stream},
				{"TransformDest()", l.TransformDest(), tt.dest},
				{"Filter(3)", l.Filter(3), tt.filter3},
				{"OutStreamSubject()", l.OutStreamSubject(), tt.outStream},
				{"UnmappedStreamSubject()", l.UnmappedStreamSubject(), tt.unmStream},
				{"MalformedSubject()", l.MalformedSubject(), tt.malfrm},
			} {
				if c.got != c.want {
					t.Errorf("%s = %q, want %q", c.call, c.got, c.want)
				}
			}
		})
	}
}

func TestStoredSubject(t *testing.T) {
	l := defaultLayout(t)
	got, err := l.StoredSubject(map[string]string{"device": "dev-42", "event": "temp"})
	want := "incoming." + strconv.Itoa(subjects.Partition("dev-42", 16)) + ".dev-42.temp"
	if err != nil || got != want {
		t.Fatalf("StoredSubject() = %q, %v; want %q, nil", got, err, want)
	}
	if _, err := l.StoredSubject(map[string]string{"device": "a.b", "event": "temp"}); !errors.Is(err, subjects.ErrInvalidToken) {
		t.Fatalf("StoredSubject(device a.b) = %v, want an error wrapping ErrInvalidToken", err)
	}
}
