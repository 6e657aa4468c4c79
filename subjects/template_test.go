package subjects_test

import (
	"errors"
	"maps"
	"slices"
	"testing"

	"github.com/kvmapper/kvmapper/subjects"
)

func TestParseTemplate(t *testing.T) {
	tests := []struct {
		name     string
		in       string
		ok       bool
		names    []string
		wildcard string
		prefix   string
	}{
		{"in", "incoming.{device}.{event}", true, []string{"device", "event"}, "incoming.*.*", "incoming"},
		{"out", "outgoing.{group}.{device}.{event}", true, []string{"group", "device", "event"}, "outgoing.*.*.*", "outgoing"},
		{"long prefix", "a.b.{device}.c.{x_1}", true, []string{"device", "x_1"}, "a.b.*.c.*", "a.b"},
		{"repeated placeholder", "a.{device}.{device}", true, []string{"device"}, "a.*.*", "a"},
		{"literal only", "a.b", true, nil, "a.b", "a.b"},
		{"starts with placeholder", "{device}.x", true, []string{"device"}, "*.x", ""},
		{"empty", "", false, nil, "", ""},
		{"empty token", "a..{device}", false, nil, "", ""},
		{"trailing dot", "a.{device}.", false, nil, "", ""},
		{"star literal", "a.*", false, nil, "", ""},
		{"gt literal", "a.>", false, nil, "", ""},
		{"space literal", "a b.{device}", false, nil, "", ""},
		{"upper name", "a.{Device}", false, nil, "", ""},
		{"digit first", "a.{1x}", false, nil, "", ""},
		{"empty name", "a.{}", false, nil, "", ""},
		{"partial placeholder", "a.x{device}", false, nil, "", ""},
		{"unclosed", "a.{device", false, nil, "", ""},
		{"double braces", "a.{{device}}", false, nil, "", ""},
		{"dash in name", "a.{dev-id}", false, nil, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tpl, err := subjects.ParseTemplate(tt.in)
			if !tt.ok {
				if !errors.Is(err, subjects.ErrInvalidTemplate) {
					t.Fatalf("ParseTemplate(%q) = %v, want an error wrapping ErrInvalidTemplate", tt.in, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseTemplate(%q) = %v, want nil", tt.in, err)
			}
			if got := tpl.String(); got != tt.in {
				t.Errorf("String() = %q, want %q", got, tt.in)
			}
			if got := tpl.Placeholders(); !slices.Equal(got, tt.names) {
				t.Errorf("Placeholders() = %q, want %q", got, tt.names)
			}
			if got := tpl.Wildcard(); got != tt.wildcard {
				t.Errorf("Wildcard() = %q, want %q", got, tt.wildcard)
			}
			if got := tpl.Prefix(); got != tt.prefix {
				t.Errorf("Prefix() = %q, want %q", got, tt.prefix)
			}
		})
	}
}

func TestTemplateRenderMatch(t *testing.T) {
	tpl, err := subjects.ParseTemplate("outgoing.{group}.{device}.x.{event}")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		values map[string]string
		want   string // "" means Render fails with ErrInvalidToken
	}{
		{"ok", map[string]string{"group": "g", "device": "dev-42", "event": "temp"}, "outgoing.g.dev-42.x.temp"},
		{"extra value ignored", map[string]string{"group": "g", "device": "d", "event": "e", "other": "o"}, "outgoing.g.d.x.e"},
		{"missing value", map[string]string{"group": "g", "device": "d"}, ""},
		{"dot in value", map[string]string{"group": "a.b", "device": "d", "event": "e"}, ""},
		{"wildcard value", map[string]string{"group": "g", "device": "*", "event": "e"}, ""},
		{"empty value", map[string]string{"group": "g", "device": "", "event": "e"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tpl.Render(tt.values)
			if tt.want == "" {
				if !errors.Is(err, subjects.ErrInvalidToken) {
					t.Fatalf("Render(%v) = %q, %v; want an error wrapping ErrInvalidToken", tt.values, got, err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("Render(%v) = %q, %v; want %q, nil", tt.values, got, err, tt.want)
			}
			back, ok := tpl.Match(got)
			want := map[string]string{"group": tt.values["group"], "device": tt.values["device"], "event": tt.values["event"]}
			if !ok || !maps.Equal(back, want) {
				t.Fatalf("Match(%q) = %v, %v; want %v, true", got, back, ok, want)
			}
		})
	}
}

func TestTemplateMatchRefuses(t *testing.T) {
	tpl, err := subjects.ParseTemplate("a.{x}.b.{y}.{x}")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"", "a", "a.1.b.2", "a.1.b.2.1.3", "c.1.b.2.1", "a.1.c.2.1", "a.1.b.2.3", "a..b.2.", "a.1 2.b.2.1 2"} {
		t.Run(s, func(t *testing.T) {
			if got, ok := tpl.Match(s); ok {
				t.Fatalf("Match(%q) = %v, true; want false", s, got)
			}
		})
	}
	if got, ok := tpl.Match("a.1.b.2.1"); !ok || got["x"] != "1" || got["y"] != "2" {
		t.Fatalf("Match(a.1.b.2.1) = %v, %v; want x=1 y=2, true", got, ok)
	}
}
