package setup

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/usage"
	"github.com/kvmapper/kvmapper/wire"
)

// ParkedStream describes the PARKED stream, which holds the messages of devices parked until they
// have a group (`kvmapper run --on-unmapped park`). Its limits are the server's: a device's
// messages are one subject, capped by max_msgs_per_subject with discard_new_per_subject, and the
// whole stream by max_msgs with discard new, so that the server refuses a message over either
// limit (the lanes then dead-letter it as park-full) rather than drop an older one.
type ParkedStream struct {
	// MaxPerDevice is the most messages one device may have parked. Default 1000.
	MaxPerDevice int64
	// MaxTotal is the most messages parked in all. Default 1,000,000.
	MaxTotal int64
	// CheckLimits makes an existing PARKED whose limits differ from MaxPerDevice and MaxTotal an
	// error naming the fix (the limits were asked for explicitly); otherwise what exists is kept.
	CheckLimits bool
}

// OnUnmapped is what the replicas do with a message of a device that has no group
// (--on-unmapped). With [OnUnmappedPark] a [Config] has a Park: [Ensure] creates PARKED.
type OnUnmapped string

const (
	// OnUnmappedDeadLetter (the default): the message goes to UNMAPPED, reason no-mapping.
	OnUnmappedDeadLetter OnUnmapped = "dead-letter"
	// OnUnmappedPark: the message waits in PARKED, with every later message of its device behind
	// it, until the device gets a group.
	OnUnmappedPark OnUnmapped = "park"
)

// ParseOnUnmapped reads an on-unmapped mode's name, "dead-letter" or "park"; "" is
// [OnUnmappedDeadLetter]. It fails wrapping [ErrInvalidConfig] for any other.
func ParseOnUnmapped(s string) (OnUnmapped, error) {
	switch o := OnUnmapped(s); o {
	case "", OnUnmappedDeadLetter:
		return OnUnmappedDeadLetter, nil
	case OnUnmappedPark:
		return o, nil
	}
	return "", usage.Value(ErrInvalidConfig, "on-unmapped", s, "use %s or %s", OnUnmappedDeadLetter, OnUnmappedPark)
}

// Default limits of a PARKED stream.
const (
	DefaultParkMaxPerDevice = 1000
	DefaultParkMaxTotal     = 1_000_000
)

func (c *ParkedStream) defaults() {
	c.MaxPerDevice = cmp.Or(c.MaxPerDevice, DefaultParkMaxPerDevice)
	c.MaxTotal = cmp.Or(c.MaxTotal, DefaultParkMaxTotal)
}

// ensureParked creates or verifies the PARKED stream. What it checks of an existing one is what
// parking relies on: the subjects, discard new per subject (an old parked message must never be
// dropped to make room), no maximum age (the lanes dead-letter what is too old; the server would
// drop it silently), purges allowed (released messages are purged) and a duplicate window as long
// as OUTGOING's (a park resent after a takeover is dropped as a duplicate).
func ensureParked(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	pc := *cfg.Park
	pc.defaults()
	subject := cfg.ParkedPrefix + ".>"
	want := jetstream.StreamConfig{
		Name:                 cfg.Parked,
		Description:          "kvmapper: messages of devices parked until they have a group, one subject per device",
		Subjects:             []string{subject},
		Storage:              jetstream.FileStorage,
		Retention:            jetstream.LimitsPolicy,
		Discard:              jetstream.DiscardNew,
		DiscardNewPerSubject: true,
		MaxMsgsPerSubject:    pc.MaxPerDevice,
		MaxMsgs:              pc.MaxTotal,
		Duplicates:           cfg.DuplicateWindow,
		Replicas:             cfg.Replicas,
		AllowBatchPublish:    true,
		AllowAtomicPublish:   cfg.Replicas > 1, // the lanes write a replicated PARKED in atomic batches
	}
	fenceOutput(&want)
	info, created, err := createOrGet(ctx, js, want)
	if err != nil {
		return "", fmt.Errorf("%w (if another stream captures %s, name other parked subjects with --parked-prefix)", err, subject)
	}
	if err := markParking(ctx, js, cfg); err != nil {
		return "", err
	}
	limits := func(c jetstream.StreamConfig) string {
		return fmt.Sprintf("at most %d messages per device and %d in all", c.MaxMsgsPerSubject, c.MaxMsgs)
	}
	if created {
		return fmt.Sprintf("created stream %s: %s, %s", cfg.Parked, subject, limits(want)), nil
	}
	got := info.Config
	name := cfg.Parked
	switch {
	case !slices.Contains(got.Subjects, subject):
		return "", fmt.Errorf("%w: stream %s captures %v, not %q: add it with `nats stream edit %s --subjects %q`, or pass the --parked-prefix it was built for",
			ErrMismatch, name, got.Subjects, subject, name, subject)
	case got.Discard != jetstream.DiscardNew || !got.DiscardNewPerSubject || got.MaxMsgsPerSubject < 1:
		return "", fmt.Errorf("%w: stream %s must refuse a device's message over its limit rather than drop an older one: `nats stream edit %s --discard new --discard-per-subject --max-msgs-per-subject %d`",
			ErrMismatch, name, name, pc.MaxPerDevice)
	case got.MaxAge != 0:
		return "", fmt.Errorf("%w: stream %s has a maximum age of %v: the server would drop parked messages silently (kvmapper dead-letters them past --park-max-age): `nats stream edit %s --max-age 0`",
			ErrMismatch, name, got.MaxAge, name)
	case got.DenyPurge:
		return "", fmt.Errorf("%w: stream %s denies purges, which releasing a device needs: recreate it without deny_purge", ErrMismatch, name)
	case got.Duplicates < MinDuplicateWindow:
		return "", fmt.Errorf("%w: stream %s has a duplicate window of %v, below the %v a takeover needs to drop what a deposed owner parked: `nats stream edit %s --dupe-window %v`",
			ErrMismatch, name, got.Duplicates, MinDuplicateWindow, name, MinDuplicateWindow)
	case pc.CheckLimits && (got.MaxMsgsPerSubject != pc.MaxPerDevice || got.MaxMsgs != pc.MaxTotal):
		return "", fmt.Errorf("%w: stream %s allows %s, not the %d and %d asked for: `nats stream edit %s --max-msgs-per-subject %d --max-msgs %d`",
			ErrMismatch, name, limits(got), pc.MaxPerDevice, pc.MaxTotal, name, pc.MaxPerDevice, pc.MaxTotal)
	}
	return fmt.Sprintf("stream %s ok: %s, %s", name, subject, limits(got)), nil
}

// markParking writes the control bucket's [wire.ParkedKey] with PARKED's name, unless it
// holds it already: replicas without --on-unmapped park, status and verify then know to drain or
// count what PARKED holds, and deployments that never parked never touch PARKED.
func markParking(ctx context.Context, js jetstream.JetStream, cfg Config) error {
	ctl, err := js.KeyValue(ctx, cfg.Control)
	if err != nil {
		return fmt.Errorf("setup: opening bucket %s: %w", cfg.Control, err)
	}
	if e, err := get(ctx, ctl, wire.ParkedKey); err == nil && string(e.Value()) == cfg.Parked {
		return nil
	} else if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("setup: reading %s in bucket %s: %w", wire.ParkedKey, cfg.Control, err)
	}
	if _, err := ctl.PutString(ctx, wire.ParkedKey, cfg.Parked); err != nil {
		return fmt.Errorf("setup: writing %s in bucket %s: %w", wire.ParkedKey, cfg.Control, err)
	}
	return nil
}
