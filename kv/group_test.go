package kv_test

import (
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/kv"
)

func TestValidGroup(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want bool
	}{
		{"plain", "group-a", true},
		{"unicode", "grüppe_1", true},
		{"max length", strings.Repeat("g", 255), true},
		{"empty", "", false},
		{"too long", strings.Repeat("g", 256), false},
		{"dot", "a.b", false},
		{"star", "*", false},
		{"gt", ">", false},
		{"embedded star", "a*", false},
		{"space", "has space", false},
		{"tab", "a\tb", false},
		{"newline", "a\n", false},
		{"nbsp", "a\u00a0b", false},
		{"ideographic space", "a\u3000b", false},
		{"nul", "a\x00b", false},
		{"del", "a\x7fb", false},
		{"c1 control", "a\u0085b", false},
		{"invalid utf8", "a\xffb", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := kv.ValidGroup(tt.in); got != tt.want {
				t.Errorf("validGroup(%q) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

func TestTrimNewlines(t *testing.T) {
	tests := map[string]string{
		"group-b\n":     "group-b",
		"group-b\r\n":   "group-b",
		"group-b\n\n":   "group-b",
		"group-b":       "group-b",
		"group-b ":      "group-b ",
		"group-b\r":     "group-b\r",
		"group-b \n":    "group-b ",
		"\n":            "",
		"group-b\t\n":   "group-b\t",
		"group-b\n\r\n": "group-b",
	}
	for in, want := range tests {
		if got := string(kv.TrimNewlines([]byte(in))); got != want {
			t.Errorf("trimNewlines(%q) = %q, want %q", in, got, want)
		}
	}
}
