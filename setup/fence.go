package setup

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// ensureFences makes every replicated output stream (OUTGOING, UNMAPPED, and PARKED when it
// exists) capture its partitions' fence subjects (subjects.FenceFilter), take atomic batches and
// allow rollups (unless it denies purges),
// updating a stream that does not yet, and records in the control bucket under [wire.FenceKey]
// which streams are fenced (docs/design-fencing.md). On one-replica streams, where the lease
// clock is the fence, it fences nothing and deletes the key: replicas then take a silent owner's
// partitions over only when its leases expire on the server.
func ensureFences(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	ctl, err := js.KeyValue(ctx, cfg.Control)
	if err != nil {
		return "", fmt.Errorf("setup: opening bucket %s: %w", cfg.Control, err)
	}
	streams := []string{cfg.Outgoing, cfg.Unmapped}
	// PARKED only where the deployment parks (a replica of one that never did may not read it).
	if _, err := get(ctx, ctl, wire.ParkedKey); err == nil || cfg.Park != nil {
		streams = append(streams, cfg.Parked)
	} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", fmt.Errorf("setup: reading %s in bucket %s: %w", wire.ParkedKey, cfg.Control, err)
	}
	unfenced := func(why string) (string, error) {
		if err := ctl.Delete(ctx, wire.FenceKey); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
			return "", fmt.Errorf("setup: deleting %s in bucket %s: %w", wire.FenceKey, cfg.Control, err)
		}
		return why, nil
	}
	var fenced, updated, growing []string
	for _, name := range streams {
		s, err := js.Stream(ctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) && name == cfg.Parked {
			return unfenced("") // PARKED recorded but gone: nothing to fence there
		}
		if err != nil {
			return "", fmt.Errorf("setup: looking up stream %s: %w", name, err)
		}
		c := s.CachedInfo().Config
		if c.Replicas < 2 {
			continue
		}
		filter := subjects.FenceFilter(name)
		// A stream that denies purges cannot roll its fence records up: it keeps one per
		// takeover (the server refuses allow_rollup with deny_purge).
		rollup := !c.DenyPurge
		if !slices.Contains(c.Subjects, filter) || !c.AllowAtomicPublish || rollup && !c.AllowRollup {
			if !slices.Contains(c.Subjects, filter) {
				c.Subjects = append(c.Subjects, filter)
			}
			c.AllowAtomicPublish, c.AllowRollup = true, rollup
			if _, err := js.UpdateStream(ctx, c); err != nil {
				// Mapping goes on unfenced, with takeovers after the lease TTL.
				return unfenced(fmt.Sprintf("warning: the output streams are not fenced: making stream %s capture its fence subjects %s, take atomic batches and roll fence records up failed: %v "+
					"(run kvmapper setup as a user allowed $JS.API.STREAM.UPDATE.%s, or `nats stream edit %s --subjects %s`, keeping the subjects it has, and allow atomic batches and rollups: allow_atomic, allow_rollup_hdrs)",
					name, filter, err, name, name, filter))
			}
			updated = append(updated, name)
		}
		if !rollup {
			growing = append(growing, name)
		}
		fenced = append(fenced, name)
	}
	if len(fenced) < len(streams) {
		return unfenced("")
	}
	want := strings.Join(fenced, ",")
	if e, err := get(ctx, ctl, wire.FenceKey); err != nil || string(e.Value()) != want {
		if _, err := ctl.PutString(ctx, wire.FenceKey, want); err != nil {
			return "", fmt.Errorf("setup: writing %s in bucket %s: %w", wire.FenceKey, cfg.Control, err)
		}
	}
	line := fmt.Sprintf("output streams %s fenced: each partition's new owner writes its record on %s.<stream>.<partition>.<incarnation> before its first write",
		want, subjects.FencePrefix)
	if len(updated) > 0 {
		line += fmt.Sprintf(" (added to %s)", strings.Join(updated, ", "))
	}
	if len(growing) > 0 {
		line += fmt.Sprintf("; warning: %s deny purges, so each keeps one fence record per takeover instead of one per partition (a stream without deny_purge rolls them up)", strings.Join(growing, ", "))
	}
	return line, nil
}

// fenceOutput makes a replicated output stream about to be created capture its fence subjects,
// take atomic batches and allow rollups (each fence record replaces the partition's last), so
// that a new deployment needs no update (see [ensureFences]).
func fenceOutput(c *jetstream.StreamConfig) {
	if c.Replicas > 1 {
		c.Subjects = append(c.Subjects, subjects.FenceFilter(c.Name))
		c.AllowAtomicPublish, c.AllowRollup = true, true
	}
}

// ReadFences returns the output streams the control bucket records as fenced ([wire.FenceKey]),
// nil when it records none.
func ReadFences(ctx context.Context, ctl jetstream.KeyValue) ([]string, error) {
	e, err := get(ctx, ctl, wire.FenceKey)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("setup: reading %s in bucket %s: %w", wire.FenceKey, ctl.Bucket(), err)
	}
	return wire.ParseFences(e.Value()), nil
}
