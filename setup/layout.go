package setup

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

var (
	// ErrNoLayout is wrapped by [RecordedLayout]'s error when nothing says which stream layout
	// a deployment uses: the control bucket records none and no INCOMING stream exists.
	ErrNoLayout = errors.New("setup: no stream layout recorded and no INCOMING stream exists")
	// ErrLayoutConflict is wrapped by the errors of [ChooseLayout], [RecordedLayout] and
	// [Ensure] when the layout asked for is not the one the control bucket records: one
	// deployment is never split across layouts. The message names both.
	ErrLayoutConflict = errors.New("setup: the stream layout asked for is not the deployment's")
)

// LayoutChoice is the stream layout a command runs with, and why.
type LayoutChoice struct {
	// Layout is [subjects.SingleStream] or [subjects.PartitionStreams], never
	// [subjects.AutoLayout].
	Layout subjects.StreamLayout
	// Why says for people what decided it: the flag, the record in the control bucket, the
	// INCOMING streams that exist, or what the server's account mapping does.
	Why string
	// Faster, when not empty, says how to get the faster [subjects.PartitionStreams] layout:
	// [ChooseLayout] sets it when it chose [subjects.SingleStream] for a new deployment because
	// the server lacks the account mapping.
	Faster string
}

// ChooseLayout returns the stream layout that [Ensure] would create or verify with cfg, for the
// commands that create (setup, run). It blocks for a few round trips, and for one probe
// publication when it must look at the server's account mapping. In direct mode there is no
// INCOMING and it decides nothing: it returns cfg's layout, or [subjects.SingleStream] for auto.
//
// A layout asked for (not [subjects.AutoLayout]) is returned as it is unless the control
// bucket records another one whose INCOMING streams still exist: that is an error wrapping
// [ErrLayoutConflict]. When the recorded layout's streams are gone (the deployment is moving,
// docs/modes-and-layouts.md "Moving a deployment from single to streams") the layout asked for
// wins and Ensure records it in place of the old one.
//
// [subjects.AutoLayout] becomes, in this order: the layout the control bucket records
// ([wire.LayoutKey]); the layout whose INCOMING streams exist (a deployment made before
// layouts were recorded); for a new deployment, [subjects.PartitionStreams] when
// cfg.CallerSetsMapping is set or when the server's account mapping partitions what devices
// publish, else [subjects.SingleStream] with [LayoutChoice].Faster set.
func ChooseLayout(ctx context.Context, js jetstream.JetStream, cfg Config) (LayoutChoice, error) {
	return chooseLayout(ctx, js, cfg, true)
}

// RecordedLayout returns the stream layout of an existing deployment, for the commands that only
// read or use it (status, verify, replay, unpark): what the control bucket records, else the
// layout whose INCOMING streams exist. For [subjects.AutoLayout] with neither, the error wraps
// [ErrNoLayout] and says to run `kvmapper setup`; a layout asked for that the record contradicts
// is an error wrapping [ErrLayoutConflict]. It never probes the server and writes nothing. In
// direct mode it returns cfg's layout, or [subjects.SingleStream] for auto.
func RecordedLayout(ctx context.Context, js jetstream.JetStream, cfg Config) (LayoutChoice, error) {
	return chooseLayout(ctx, js, cfg, false)
}

func chooseLayout(ctx context.Context, js jetstream.JetStream, cfg Config, create bool) (LayoutChoice, error) {
	cfg.Defaults()
	asked := cfg.StreamLayout
	if cfg.Mode == wire.ModeDirect {
		if asked == subjects.AutoLayout {
			asked = subjects.SingleStream
		}
		return LayoutChoice{Layout: asked, Why: "direct mode keeps no INCOMING"}, nil
	}
	if cfg.Layout == nil {
		return LayoutChoice{}, fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	if asked != subjects.AutoLayout {
		if _, err := subjects.ParseStreamLayout(string(asked)); err != nil {
			return LayoutChoice{}, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
	}
	recorded, err := readLayout(ctx, js, cfg.Control)
	if err != nil {
		return LayoutChoice{}, err
	}
	if asked != subjects.AutoLayout {
		if recorded == "" || recorded == asked {
			return LayoutChoice{Layout: asked, Why: "--layout " + string(asked)}, nil
		}
		if create {
			gone, err := layoutGone(ctx, js, cfg, recorded)
			if err != nil {
				return LayoutChoice{}, err
			}
			if gone {
				return LayoutChoice{Layout: asked, Why: fmt.Sprintf("--layout %s, moving from %s (recorded in bucket %s), whose INCOMING streams are gone", asked, recorded, cfg.Control)}, nil
			}
		}
		return LayoutChoice{}, conflict(cfg, asked, recorded)
	}
	if recorded != "" {
		return LayoutChoice{Layout: recorded, Why: fmt.Sprintf("recorded in bucket %s", cfg.Control)}, nil
	}
	existing, stream, err := existingLayout(ctx, js, cfg)
	if err != nil {
		return LayoutChoice{}, err
	}
	if existing != "" {
		return LayoutChoice{Layout: existing, Why: fmt.Sprintf("stream %s exists", stream)}, nil
	}
	if !create && markedDirect(ctx, js, cfg.Control) {
		// A direct-mode deployment read without --mode direct: status and verify read the
		// mark themselves and say what they can do; there is no INCOMING to choose a layout for.
		return LayoutChoice{Layout: subjects.SingleStream, Why: fmt.Sprintf("bucket %s marks direct mode (key %s), which keeps no INCOMING", cfg.Control, wire.ModeKey)}, nil
	}
	if !create {
		return LayoutChoice{}, fmt.Errorf("%w: bucket %s records no layout (key %s) and neither %s nor %s exists: run `kvmapper setup` first, or check --server and the stream and bucket names",
			ErrNoLayout, cfg.Control, wire.LayoutKey, cfg.Incoming, cfg.PartitionStream(0))
	}
	if cfg.CallerSetsMapping {
		return LayoutChoice{Layout: subjects.PartitionStreams, Why: "a new deployment on a server given the account mapping by kvmapper itself"}, nil
	}
	active, err := mappingActive(ctx, js.Conn(), cfg.Layout)
	if err != nil {
		return LayoutChoice{}, err
	}
	lay := cfg.Layout
	if active {
		return LayoutChoice{Layout: subjects.PartitionStreams, Why: fmt.Sprintf("a new deployment on a server whose account mapping partitions %s", lay.MappingSource())}, nil
	}
	return LayoutChoice{
		Layout: subjects.SingleStream,
		Why:    fmt.Sprintf("a new deployment on a server without the account mapping of %s into partitions", lay.MappingSource()),
		Faster: fmt.Sprintf("--layout streams would map 1.4–1.8× as fast (docs/modes-and-layouts.md: Stream layouts): give every server the account mapping %q → %q, then move the deployment to it (docs/modes-and-layouts.md: Moving a deployment from single to streams)",
			lay.MappingSource(), lay.MappingDest()),
	}, nil
}

// conflict is the error for a layout asked for that the control bucket contradicts.
func conflict(cfg Config, asked, recorded subjects.StreamLayout) error {
	return fmt.Errorf("%w: --layout %s was asked for, but bucket %s records this deployment's layout as %s (key %s): run with --layout %s, or --layout auto (the default), which reads it; to move the deployment to %s, see docs/modes-and-layouts.md (Moving a deployment from single to streams)",
		ErrLayoutConflict, asked, cfg.Control, recorded, wire.LayoutKey, recorded, asked)
}

// readLayout returns the layout the control bucket records, or "" when the bucket or the key
// does not exist.
func readLayout(ctx context.Context, js jetstream.JetStream, bucket string) (subjects.StreamLayout, error) {
	ctl, err := js.KeyValue(ctx, bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("setup: opening bucket %s: %w", bucket, err)
	}
	e, err := get(ctx, ctl, wire.LayoutKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("setup: reading %s in bucket %s: %w", wire.LayoutKey, bucket, err)
	}
	l, err := subjects.ParseStreamLayout(string(e.Value()))
	if err != nil || len(e.Value()) == 0 {
		return "", fmt.Errorf("%w: key %s of bucket %s holds %q, which names no stream layout: `nats kv put %s %s single` (or streams), whichever INCOMING streams exist",
			ErrMismatch, wire.LayoutKey, bucket, e.Value(), bucket, wire.LayoutKey)
	}
	return l, nil
}

// markedDirect reports whether the control bucket marks the deployment as running in direct
// mode ([wire.ModeKey]); a bucket or key that cannot be read marks nothing.
func markedDirect(ctx context.Context, js jetstream.JetStream, bucket string) bool {
	ctl, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return false
	}
	e, err := get(ctx, ctl, wire.ModeKey)
	return err == nil && wire.MarksDirect(e.Value())
}

// existingLayout returns the layout whose INCOMING streams exist, with the name of the one
// found, or "" when neither INCOMING nor the first partition stream exists.
func existingLayout(ctx context.Context, js jetstream.JetStream, cfg Config) (subjects.StreamLayout, string, error) {
	for _, c := range []struct {
		l    subjects.StreamLayout
		name string
	}{{subjects.SingleStream, cfg.Incoming}, {subjects.PartitionStreams, cfg.PartitionStream(0)}} {
		_, err := js.Stream(ctx, c.name)
		if err == nil {
			return c.l, c.name, nil
		}
		if !errors.Is(err, jetstream.ErrStreamNotFound) {
			return "", "", fmt.Errorf("setup: looking up stream %s: %w", c.name, err)
		}
	}
	return "", "", nil
}

// layoutGone reports whether no INCOMING stream of layout l exists.
func layoutGone(ctx context.Context, js jetstream.JetStream, cfg Config, l subjects.StreamLayout) (bool, error) {
	name := cfg.Incoming
	if l == subjects.PartitionStreams {
		name = cfg.PartitionStream(0)
	}
	_, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("setup: looking up stream %s: %w", name, err)
	}
	return false, nil
}

// recordLayout writes cfg's layout under [wire.LayoutKey] in the control bucket, unless it
// is there already, and returns the report line. Another layout recorded there is replaced only
// when its INCOMING streams are gone ([ChooseLayout] allowed the move); two setups racing to
// record different layouts leave the first and fail the second.
func recordLayout(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	ctl, err := js.KeyValue(ctx, cfg.Control)
	if err != nil {
		return "", fmt.Errorf("setup: opening bucket %s: %w", cfg.Control, err)
	}
	want := cfg.StreamLayout
	readers := "every command with --layout auto (the default) reads it"
	e, err := get(ctx, ctl, wire.LayoutKey)
	switch {
	case err == nil && string(e.Value()) == string(want):
		return fmt.Sprintf("layout %s, as recorded in bucket %s (key %s): %s", want, cfg.Control, wire.LayoutKey, readers), nil
	case err == nil:
		gone, gerr := layoutGone(ctx, js, cfg, subjects.StreamLayout(e.Value()))
		if gerr != nil {
			return "", gerr
		}
		if !gone {
			return "", conflict(cfg, want, subjects.StreamLayout(e.Value()))
		}
		if _, err := ctl.Update(ctx, wire.LayoutKey, []byte(want), e.Revision()); err != nil {
			return "", fmt.Errorf("setup: writing %s in bucket %s: %w", wire.LayoutKey, cfg.Control, err)
		}
		return fmt.Sprintf("recorded layout %s in bucket %s (key %s) in place of %s: %s", want, cfg.Control, wire.LayoutKey, e.Value(), readers), nil
	case !errors.Is(err, jetstream.ErrKeyNotFound):
		return "", fmt.Errorf("setup: reading %s in bucket %s: %w", wire.LayoutKey, cfg.Control, err)
	}
	if _, err := ctl.Create(ctx, wire.LayoutKey, []byte(want)); err != nil {
		// Another setup may have recorded it meanwhile: what matters is what is there now.
		got, rerr := readLayout(ctx, js, cfg.Control)
		if rerr != nil || got == "" {
			return "", fmt.Errorf("setup: writing %s in bucket %s: %w", wire.LayoutKey, cfg.Control, err)
		}
		if got != want {
			return "", conflict(cfg, want, got)
		}
	}
	return fmt.Sprintf("recorded layout %s in bucket %s (key %s): %s", want, cfg.Control, wire.LayoutKey, readers), nil
}

// mappingProbeDevice is the device of the probe [mappingActive] publishes.
const mappingProbeDevice = wire.ProbeDevicePrefix + "0"

// mappingActive reports whether the server's account mapping partitions what devices publish:
// it subscribes to a probe subject as devices publish it and as the mapping would deliver it
// (any partition), publishes one probe, and sees which of the two it comes back on. Unlike
// [CheckMapping] it needs no stream: it runs before setup creates any. The probe carries a
// Nats-Expected-Stream that names no stream, so a stream that captures it stores nothing.
func mappingActive(ctx context.Context, nc *nats.Conn, lay *subjects.Layout) (bool, error) {
	subject, err := probeSubject(lay, mappingProbeDevice)
	if err != nil {
		return false, err
	}
	prefix := lay.In.Prefix()
	mapped := prefix + ".*" + subject[len(prefix):]
	got := make(chan *nats.Msg, 4)
	for _, s := range []string{subject, mapped} {
		sub, err := nc.ChanSubscribe(s, got)
		if err != nil {
			return false, fmt.Errorf("setup: subscribing to %s to probe the account mapping: %w", s, err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	m := nats.NewMsg(subject)
	m.Header.Set(jetstream.ExpectedStreamHeader, probeExpect)
	if err := nc.PublishMsg(m); err != nil {
		return false, fmt.Errorf("setup: probing the account mapping on %s: %w", subject, err)
	}
	fctx, cancel := context.WithTimeout(ctx, probeTimeout)
	err = nc.FlushWithContext(fctx)
	cancel()
	if err != nil {
		return false, fmt.Errorf("setup: probing the account mapping on %s: %w", subject, err)
	}
	t := time.NewTimer(probeTimeout)
	defer t.Stop()
	select {
	case msg := <-got:
		// Delivered unchanged: no mapping. Delivered with a partition token, even one of
		// another partition count: a mapping, which Ensure then checks partition by partition.
		return msg.Subject != subject, nil
	case <-t.C:
		return false, fmt.Errorf("setup: choosing the stream layout: a probe published to %s came back neither as it was nor as %s within %v: the user may lack permission to subscribe to them (docs/security.md: Least privilege), or the account maps %s elsewhere; choose with --layout single or --layout streams",
			subject, mapped, probeTimeout, lay.MappingSource())
	case <-ctx.Done():
		return false, fmt.Errorf("setup: probing the account mapping on %s: %w", subject, ctx.Err())
	}
}
