package subjects_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/subjects"
)

func TestParse(t *testing.T) {
	l := defaultLayout(t)
	tests := []struct {
		name, stored  string
		partition     int
		device, event string
		why           string // substring of the error; "" means valid
	}{
		{"ok", "incoming.7.dev-42.temp", 7, "dev-42", "temp", ""},
		{"partition zero", "incoming.0.d.e", 0, "d", "e", ""},
		{"last partition", "incoming.15.d.e", 15, "d", "e", ""},
		{"utf8 device", "incoming.3.héllo.e", 3, "héllo", "e", ""},
		{"star inside token", "incoming.3.a*b.e", 3, "a*b", "e", ""},
		{"empty", "", 0, "", "", "does not start with"},
		{"prefix only", "incoming", 0, "", "", "does not start with"},
		{"other prefix", "outgoing.7.d.e", 0, "", "", "does not start with"},
		{"prefix substring", "incomingx.7.d.e", 0, "", "", "does not start with"},
		{"unpartitioned", "incoming.d.e", 0, "", "", "partition token \"d\""},
		{"partition only", "incoming.7", 0, "", "", "too few tokens"},
		{"too few", "incoming.7.d", 0, "", "", "too few tokens"},
		{"too many", "incoming.7.d.e.f", 0, "", "", "too many tokens"},
		{"trailing dot", "incoming.7.d.e.", 0, "", "", "too many tokens"},
		{"empty device", "incoming.7..e", 0, "", "", "empty token"},
		{"empty event", "incoming.7.d.", 0, "", "", "empty token"},
		{"empty partition", "incoming..d.e", 0, "", "", "partition token \"\""},
		{"partition out of range", "incoming.16.d.e", 0, "", "", "partition token \"16\""},
		{"partition huge", "incoming.99999999999999999999.d.e", 0, "", "", "not a number"},
		{"partition negative", "incoming.-1.d.e", 0, "", "", "not a number"},
		{"partition leading zero", "incoming.07.d.e", 0, "", "", "not a number"},
		{"partition plus", "incoming.+7.d.e", 0, "", "", "not a number"},
		{"wildcard device", "incoming.7.*.e", 0, "", "", "wildcard token"},
		{"wildcard event", "incoming.7.d.>", 0, "", "", "wildcard token"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var f subjects.Fields
			err := l.Parse(tt.stored, &f)
			if tt.why != "" {
				if !errors.Is(err, subjects.ErrMalformedSubject) {
					t.Fatalf("Parse(%q) = %v, want an error wrapping ErrMalformedSubject", tt.stored, err)
				}
				if !strings.Contains(err.Error(), tt.why) {
					t.Fatalf("Parse(%q) = %q, want it to say %q", tt.stored, err, tt.why)
				}
				if f.Device() != "" || f.Partition() != 0 {
					t.Fatalf("after a failed Parse, Device() = %q, Partition() = %d; want empty fields", f.Device(), f.Partition())
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse(%q) = %v, want nil", tt.stored, err)
			}
			if f.Partition() != tt.partition || f.Device() != tt.device || f.Value("event") != tt.event {
				t.Fatalf("Parse(%q): Partition() = %d, Device() = %q, Value(event) = %q; want %d, %q, %q",
					tt.stored, f.Partition(), f.Device(), f.Value("event"), tt.partition, tt.device, tt.event)
			}
			if got := f.Value("nope"); got != "" {
				t.Fatalf("Value(nope) = %q, want empty", got)
			}
			if got := f.Subject(); got != tt.stored {
				t.Fatalf("Subject() = %q, want %q", got, tt.stored)
			}
		})
	}
}

func TestParseZeroFields(t *testing.T) {
	var f subjects.Fields
	if f.Device() != "" || f.Partition() != 0 || f.Value("device") != "" {
		t.Fatalf("zero Fields: Device() = %q, Partition() = %d; want empty", f.Device(), f.Partition())
	}
}

func TestAppend(t *testing.T) {
	tests := []struct {
		name              string
		in, out, unmapped string
		stored, group     string
		wantOut, wantUnm  string
	}{
		{"defaults", defIn, defOut, defUnmapped, "incoming.3.dev-42.temp", "group-b",
			"outgoing.group-b.dev-42.temp", "unmapped.dev-42.temp"},
		{"reordered", defIn, "out.x.{event}.{group}.y.{device}", "dead.{event}", "incoming.0.d.e", "g",
			"out.x.e.g.y.d", "dead.e"},
		{"device twice", "in.{device}", "o.{group}.{device}.{device}", "u.{device}.{device}", "in.2.d", "g",
			"o.g.d.d", "u.d.d"},
		{"literals inside in", "a.b.{site}.x.{device}", "o.{group}.{device}.{site}", "u.{site}.{device}", "a.b.1.s.x.d", "g",
			"o.g.d.s", "u.s.d"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := subjects.NewLayout(tt.in, tt.out, tt.unmapped, 4)
			if err != nil {
				t.Fatalf("NewLayout() = %v", err)
			}
			var f subjects.Fields
			if err := l.Parse(tt.stored, &f); err != nil {
				t.Fatalf("Parse(%q) = %v", tt.stored, err)
			}
			if got := string(l.AppendOut([]byte("pre:"), &f, subjects.PackValues(tt.group))); got != "pre:"+tt.wantOut {
				t.Errorf("AppendOut(pre:) = %q, want %q", got, "pre:"+tt.wantOut)
			}
			if got := string(l.AppendUnmapped(nil, &f)); got != tt.wantUnm {
				t.Errorf("AppendUnmapped(nil) = %q, want %q", got, tt.wantUnm)
			}
		})
	}
}

func TestZeroAllocs(t *testing.T) {
	l := defaultLayout(t)
	const stored = "incoming.7.dev-42.temp"
	var f subjects.Fields
	buf := make([]byte, 0, 256)
	var sink int
	v := subjects.PackValues("group-b")
	if n := testing.AllocsPerRun(1000, func() {
		if err := l.Parse(stored, &f); err != nil {
			t.Fatal(err)
		}
		sink += len(f.Device())
		buf = l.AppendOut(buf[:0], &f, v)
	}); n != 0 {
		t.Errorf("Parse + Device + AppendOut: %v allocs per run, want 0", n)
	}
	if n := testing.AllocsPerRun(1000, func() { buf = l.AppendUnmapped(buf[:0], &f) }); n != 0 {
		t.Errorf("AppendUnmapped: %v allocs per run, want 0", n)
	}
	if n := testing.AllocsPerRun(1000, func() { sink += subjects.Partition("dev-42", 16) }); n != 0 {
		t.Errorf("Partition: %v allocs per run, want 0", n)
	}
	_ = sink
}

func BenchmarkParse(b *testing.B) {
	l := defaultLayout(b)
	var f subjects.Fields
	b.ReportAllocs()
	for b.Loop() {
		if err := l.Parse("incoming.7.dev-42.temp", &f); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAppendOut(b *testing.B) {
	l := defaultLayout(b)
	var f subjects.Fields
	if err := l.Parse("incoming.7.dev-42.temp", &f); err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 0, 256)
	v := subjects.PackValues("group-b")
	b.ReportAllocs()
	for b.Loop() {
		buf = l.AppendOut(buf[:0], &f, v)
	}
}

func BenchmarkPartition(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		subjects.Partition("dev-42", 16)
	}
}
