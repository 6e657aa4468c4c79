package usage_test

import (
	"errors"
	"io/fs"
	"testing"

	"github.com/kvmapper/kvmapper/internal/usage"
)

var errInvalid = errors.New("pkg: invalid config")

// An error reads as its message alone and wraps both the sentinel and what the format wraps.
func TestErrorsWrapTheSentinel(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{usage.Value(errInvalid, "layout", "sharded", "use %s or %s", "single", "streams"), `invalid value "sharded" for flag --layout: use single or streams`},
		{usage.Value(errInvalid, "stream-replicas", 7, "must be 1 to 5"), "invalid value 7 for flag --stream-replicas: must be 1 to 5"},
		{usage.Errorf(errInvalid, "--on-unmapped park needs --mode stream: %w", fs.ErrInvalid), "--on-unmapped park needs --mode stream: invalid argument"},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("Error() = %q, want %q", got, tc.want)
		}
		if !errors.Is(tc.err, errInvalid) {
			t.Errorf("errors.Is(%q, errInvalid) = false, want true", tc.err)
		}
	}
	if err := usage.Errorf(errInvalid, "wrapped: %w", fs.ErrInvalid); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("errors.Is(%q, fs.ErrInvalid) = false, want true", err)
	}
	also := usage.Also(usage.Value(errInvalid, "mode", "fast", "use stream or direct"), fs.ErrInvalid)
	if also.Error() != `invalid value "fast" for flag --mode: use stream or direct` || !errors.Is(also, fs.ErrInvalid) || !errors.Is(also, errInvalid) {
		t.Errorf("Also() = %q, want the message alone, wrapping both fs.ErrInvalid and errInvalid", also)
	}
}
