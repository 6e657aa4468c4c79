package ratelog_test

import (
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/ratelog"
)

func TestLimiter(t *testing.T) {
	var l ratelog.Limiter
	t0 := time.Unix(1000, 0)
	steps := []struct {
		kind       string
		at         time.Duration
		suppressed int
		ok         bool
	}{
		{"a", 0, 0, true},
		{"a", 10 * time.Millisecond, 0, false},
		{"b", 20 * time.Millisecond, 0, true}, // kinds are limited apart
		{"a", 999 * time.Millisecond, 0, false},
		{"a", time.Second, 2, true},
		{"a", 1500 * time.Millisecond, 0, false},
		{"b", 3 * time.Second, 0, true},
		{"a", 3 * time.Second, 1, true},
	}
	for i, s := range steps {
		n, ok := l.AllowAt(s.kind, t0.Add(s.at))
		if n != s.suppressed || ok != s.ok {
			t.Errorf("step %d: AllowAt(%q, +%v) = %d, %v; want %d, %v", i, s.kind, s.at, n, ok, s.suppressed, s.ok)
		}
	}
}

func TestLimiterEvery(t *testing.T) {
	l := ratelog.Limiter{Every: time.Minute}
	t0 := time.Unix(1000, 0)
	l.AllowAt("a", t0)
	if _, ok := l.AllowAt("a", t0.Add(30*time.Second)); ok {
		t.Error("AllowAt(+30s) with Every 1m = ok, want held back")
	}
	if n, ok := l.AllowAt("a", t0.Add(time.Minute)); !ok || n != 1 {
		t.Errorf("AllowAt(+1m) = %d, %v; want 1, true", n, ok)
	}
}
