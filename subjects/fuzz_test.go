package subjects_test

import (
	"errors"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvmapper/kvmapper/subjects"
)

func FuzzParseTemplate(f *testing.F) {
	for _, s := range []string{defIn, defOut, defUnmapped, "a.{x}.{x}", "", "a..b", "{a}", "a.{B}", "a.x{y}", "é.{é}", "a.{{b}}"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tpl, err := subjects.ParseTemplate(s)
		if err != nil {
			if !errors.Is(err, subjects.ErrInvalidTemplate) {
				t.Fatalf("ParseTemplate(%q) = %v, want an error wrapping ErrInvalidTemplate", s, err)
			}
			return
		}
		if tpl.String() != s {
			t.Fatalf("String() = %q, want %q", tpl.String(), s)
		}
		again, err := subjects.ParseTemplate(tpl.String())
		if err != nil || again.String() != s || !slices.Equal(again.Placeholders(), tpl.Placeholders()) {
			t.Fatalf("ParseTemplate(String()) = %v, %v; want the same template", again, err)
		}
		if strings.Count(tpl.Wildcard(), ".") != strings.Count(s, ".") {
			t.Fatalf("Wildcard() = %q has a different token count from %q", tpl.Wildcard(), s)
		}
	})
}

// FuzzNewLayout checks that every layout NewLayout accepts yields a transform the server accepts.
func FuzzNewLayout(f *testing.F) {
	f.Add(defIn, defOut, defUnmapped, 16)
	f.Add("a.b.{site}.x.{device}", "o.{group}.{device}", "u.{device}", 3)
	f.Add("incoming.{device}", "incoming.{group}.{device}", "u.{device}", 3)
	f.Fuzz(func(t *testing.T, in, out, unmapped string, p int) {
		l, err := subjects.NewLayout(in, out, unmapped, p)
		if err != nil {
			if !errors.Is(err, subjects.ErrInvalidTemplate) {
				t.Fatalf("NewLayout() = %v, want an error wrapping ErrInvalidTemplate", err)
			}
			return
		}
		if _, err := server.NewSubjectTransform(l.TransformSource(), l.TransformDest()); err != nil {
			t.Fatalf("server refuses transform %q -> %q: %v", l.TransformSource(), l.TransformDest(), err)
		}
	})
}

// rebuild writes the stored subject back from f, token by token, independently of the package.
func rebuild(l *subjects.Layout, f *subjects.Fields) string {
	tokens := strings.Split(l.In.String(), ".")
	lead := strings.Count(l.In.Prefix(), ".") + 1
	out := append([]string{}, tokens[:lead]...)
	out = append(out, strconv.Itoa(f.Partition()))
	for _, tok := range tokens[lead:] {
		if strings.HasPrefix(tok, "{") {
			tok = f.Value(tok[1 : len(tok)-1])
		}
		out = append(out, tok)
	}
	return strings.Join(out, ".")
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{"incoming.7.dev-42.temp", "incoming.0.d.e", "incoming.16.d.e", "incoming.07.d.e",
		"incoming.7..e", "incoming.7.d.e.f", "a.b.1.s.x.d", "a.b.1.s.y.d", "incoming.3.*.e", ""} {
		f.Add(s)
	}
	layouts := []*subjects.Layout{defaultLayout(f)}
	l2, err := subjects.NewLayout("a.b.{site}.x.{device}", "o.{group}.{device}.{site}", "u.{device}", 4)
	if err != nil {
		f.Fatal(err)
	}
	layouts = append(layouts, l2)
	f.Fuzz(func(t *testing.T, stored string) {
		for _, l := range layouts {
			var fl subjects.Fields
			if err := l.Parse(stored, &fl); err != nil {
				if !errors.Is(err, subjects.ErrMalformedSubject) {
					t.Fatalf("Parse(%q) = %v, want an error wrapping ErrMalformedSubject", stored, err)
				}
				continue
			}
			if got := rebuild(l, &fl); got != stored {
				t.Fatalf("Parse(%q) then rebuild = %q", stored, got)
			}
			if fl.Partition() < 0 || fl.Partition() >= l.Partitions {
				t.Fatalf("Parse(%q): Partition() = %d, want 0 to %d", stored, fl.Partition(), l.Partitions-1)
			}
			out := string(l.AppendOut(nil, &fl, subjects.PackValues("g")))
			if want := "." + fl.Device(); !strings.Contains(out, want) || !strings.HasPrefix(out, l.Out.Prefix()+".g.") {
				t.Fatalf("AppendOut(%q) = %q, want the group and device", stored, out)
			}
			if unm := string(l.AppendUnmapped(nil, &fl)); !strings.HasPrefix(unm, l.Unmapped.Prefix()+".") {
				t.Fatalf("AppendUnmapped(%q) = %q, want prefix %q", stored, unm, l.Unmapped.Prefix())
			}
		}
	})
}

func FuzzRenderMatch(f *testing.F) {
	f.Add("group-b", "dev-42", "temp")
	f.Add("a.b", "*", "")
	f.Add("héllo", "x y", "\x01")
	tpl, err := subjects.ParseTemplate("outgoing.{group}.{device}.x.{event}.{device}")
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, group, device, event string) {
		values := map[string]string{"group": group, "device": device, "event": event}
		valid := subjects.ValidToken(group) == nil && subjects.ValidToken(device) == nil && subjects.ValidToken(event) == nil
		s, err := tpl.Render(values)
		if !valid {
			if !errors.Is(err, subjects.ErrInvalidToken) {
				t.Fatalf("Render(%q) = %q, %v; want an error wrapping ErrInvalidToken", values, s, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("Render(%q) = %v", values, err)
		}
		got, ok := tpl.Match(s)
		if !ok || !maps.Equal(got, values) {
			t.Fatalf("Match(Render(%q)) = %q, %v; want the values back", values, got, ok)
		}
	})
}
