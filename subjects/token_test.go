package subjects_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/subjects"
)

func TestValidToken(t *testing.T) {
	tests := []struct {
		name, in string
		why      string // substring of the error; "" means valid
	}{
		{"simple", "group-b", ""},
		{"accented", "héllo", ""},
		{"max length", strings.Repeat("a", subjects.MaxTokenLen), ""},
		{"replacement char is valid UTF-8", "a\uFFFDb", ""},
		{"dot", "a.b", "contains '.'"},
		{"star", "*", "contains '*'"},
		{"star inside", "a*b", "contains '*'"},
		{"gt", ">", "contains '>'"},
		{"empty", "", "empty"},
		{"300 chars", strings.Repeat("x", 300), "longer than 255 bytes"},
		{"space", "with space", "white space"},
		{"tab", "tab\t", "white space"},
		{"newline", "a\nb", "white space"},
		{"no-break space", "a\u00a0b", "white space"},
		{"control", "\x01", "control character"},
		{"delete", "a\x7f", "control character"},
		{"invalid utf8", "a\xffb", "not valid UTF-8"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := subjects.ValidToken(tt.in)
			if tt.why == "" {
				if err != nil {
					t.Fatalf("ValidToken(%q) = %v, want nil", tt.in, err)
				}
				return
			}
			if !errors.Is(err, subjects.ErrInvalidToken) {
				t.Fatalf("ValidToken(%q) = %v, want an error wrapping ErrInvalidToken", tt.in, err)
			}
			if !strings.Contains(err.Error(), tt.why) {
				t.Fatalf("ValidToken(%q) = %q, want it to say %q", tt.in, err, tt.why)
			}
		})
	}
}

// IsValidToken and ValidToken agree: the groups table checks values with the one, and every
// other token (replica ids, groups in setup) with the other. ValidToken accepts exactly what
// IsValidToken accepts (it asks it first, and TestValidToken's table pins the rules down); here,
// every token IsValidToken refuses must get a reason from ValidToken's own rules, not its
// catch-all, so the two rule sets cannot drift apart.
func FuzzIsValidToken(f *testing.F) {
	for _, s := range []string{"", "a", "group-a", "a.b", "*", ">", "a b", "a\tb", "\x7f", "\xff", "\u00a0", "\u0085", "grüppe", "\ufffd"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		err := subjects.ValidToken(s)
		if got, want := subjects.IsValidToken(s), err == nil; got != want {
			t.Errorf("IsValidToken(%q) = %v, ValidToken(%q) = %v", s, got, s, err)
		}
		if err != nil && err.Error() == fmt.Sprintf("%v: %q", subjects.ErrInvalidToken, s) {
			t.Errorf("ValidToken(%q) = %v: IsValidToken refused a token ValidToken's rules find nothing wrong with", s, err)
		}
	})
}

func TestIsValidTokenAllocs(t *testing.T) {
	if n := testing.AllocsPerRun(100, func() { subjects.IsValidToken("group-with-a-longish-name") }); n != 0 {
		t.Errorf("IsValidToken allocates %v times per call, want 0", n)
	}
}
