package setup_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/wire"
)

func TestEnsureParked(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	ctx := context.Background()
	cfg := setup.Config{Layout: layout(t, 16), Park: &setup.ParkedStream{MaxPerDevice: 10, MaxTotal: 50}}

	lines, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	if got := lines[len(lines)-1]; !strings.HasPrefix(got, "created stream PARKED: parked.>, at most 10 messages per device and 50 in all") {
		t.Errorf("Ensure's last line = %q, want PARKED created with its limits", got)
	}
	s, err := js.Stream(ctx, "PARKED")
	if err != nil {
		t.Fatal(err)
	}
	c := s.CachedInfo().Config
	if c.Discard != jetstream.DiscardNew || !c.DiscardNewPerSubject || c.MaxMsgsPerSubject != 10 || c.MaxMsgs != 50 ||
		c.MaxAge != 0 || c.Duplicates < setup.MinDuplicateWindow {
		t.Errorf("PARKED config = %+v: want discard new per subject, 10 per device, 50 in all, no max age, a 2m duplicate window", c)
	}

	// The control bucket says the deployment parks: replicas without parking drain it then.
	ctl, err := js.KeyValue(ctx, "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	if e, err := ctl.Get(ctx, wire.ParkedKey); err != nil || string(e.Value()) != "PARKED" {
		t.Errorf("control bucket key %s: %v, %v; want PARKED", wire.ParkedKey, e, err)
	}

	// Without CheckLimits other limits are kept; with it they are a mismatch naming the fix.
	other := cfg
	other.Park = &setup.ParkedStream{MaxPerDevice: 20}
	if lines, err = setup.Ensure(ctx, js, other); err != nil || !strings.Contains(lines[len(lines)-1], "stream PARKED ok") {
		t.Fatalf("Ensure with other limits, not checked = %q, %v; want ok", lines, err)
	}
	other.Park.CheckLimits = true
	if _, err = setup.Ensure(ctx, js, other); !errors.Is(err, setup.ErrMismatch) || !strings.Contains(err.Error(), "--max-msgs-per-subject 20") {
		t.Errorf("Ensure with other limits, checked = %v; want ErrMismatch naming the fix", err)
	}

	// A maximum age would drop parked messages without a dead letter.
	c.MaxAge = time.Hour
	if _, err := js.UpdateStream(ctx, c); err != nil {
		t.Fatal(err)
	}
	if _, err = setup.Ensure(ctx, js, cfg); !errors.Is(err, setup.ErrMismatch) || !strings.Contains(err.Error(), "--max-age 0") {
		t.Errorf("Ensure with a max age on PARKED = %v; want ErrMismatch naming the fix", err)
	}

	// Without Park, PARKED is not looked at.
	if lines, err = setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16)}); err != nil || len(lines) != 6 {
		t.Errorf("Ensure without Park = %d lines, %v; want the six others", len(lines), err)
	}
	bad := cfg
	bad.Park = &setup.ParkedStream{MaxPerDevice: 100, MaxTotal: 10}
	if _, err := setup.Ensure(ctx, js, bad); !errors.Is(err, setup.ErrInvalidConfig) {
		t.Errorf("Ensure with a total below the per-device limit = %v; want ErrInvalidConfig", err)
	}
}

func TestParseOnUnmapped(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]setup.OnUnmapped{"": setup.OnUnmappedDeadLetter, "dead-letter": setup.OnUnmappedDeadLetter, "park": setup.OnUnmappedPark} {
		if got, err := setup.ParseOnUnmapped(in); got != want || err != nil {
			t.Errorf("ParseOnUnmapped(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := setup.ParseOnUnmapped("hold"); !errors.Is(err, setup.ErrInvalidConfig) {
		t.Errorf("ParseOnUnmapped(hold) = %v, want ErrInvalidConfig", err)
	}
}
