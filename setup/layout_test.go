package setup_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// autoConfig is --layout auto with the default names and 16 partitions.
func autoConfig(t *testing.T) setup.Config {
	return setup.Config{Layout: layout(t, 16), Names: subjects.Names{StreamLayout: subjects.AutoLayout}}
}

// forgetLayout deletes the layout setup recorded, as in a deployment made before setup recorded
// layouts.
func forgetLayout(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	ctl, err := js.KeyValue(context.Background(), "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	if err := ctl.Purge(context.Background(), wire.LayoutKey); err != nil {
		t.Fatalf("Purge(%s): %v", wire.LayoutKey, err)
	}
}

// recorded returns the layout the control bucket records.
func recorded(t *testing.T, js jetstream.JetStream) string {
	t.Helper()
	ctl, err := js.KeyValue(context.Background(), "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	e, err := ctl.Get(context.Background(), wire.LayoutKey)
	if err != nil {
		t.Fatalf("Get(%s): %v", wire.LayoutKey, err)
	}
	return string(e.Value())
}

func exists(t *testing.T, js jetstream.JetStream, stream string) bool {
	t.Helper()
	_, err := js.Stream(context.Background(), stream)
	if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatal(err)
	}
	return err == nil
}

// A new deployment gets the partition streams when the server's account mapping is active, the
// single stream (and how to get the faster layout) when it is not; setup creates that layout
// alone and records it.
func TestAutoLayoutOfANewDeployment(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, tc := range map[string]struct {
		mapping     bool
		want        subjects.StreamLayout
		has, hasNot string
		faster, why string
	}{
		"mapping active": {mapping: true, want: subjects.PartitionStreams, has: "INCOMING-0", hasNot: "INCOMING", why: "account mapping partitions incoming.*.*"},
		"no mapping": {want: subjects.SingleStream, has: "INCOMING", hasNot: "INCOMING-0", why: "without the account mapping",
			faster: `1.4–1.8× as fast (docs/modes-and-layouts.md: Stream layouts): give every server the account mapping "incoming.*.*" → "incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}"`},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := autoConfig(t)
			srv := natstest.Start(t)
			if tc.mapping {
				srv = mapped(t, cfg.Layout)
			}
			_, js := srv.JetStream(t)
			choice, err := setup.ChooseLayout(ctx, js, cfg)
			if err != nil {
				t.Fatalf("ChooseLayout: %v", err)
			}
			if choice.Layout != tc.want || !strings.Contains(choice.Why, tc.why) {
				t.Errorf("ChooseLayout = %s (%s), want %s (… %s …)", choice.Layout, choice.Why, tc.want, tc.why)
			}
			if tc.faster == "" && choice.Faster != "" || !strings.Contains(choice.Faster, tc.faster) {
				t.Errorf("ChooseLayout's Faster = %q, want %q", choice.Faster, tc.faster)
			}
			lines, err := setup.Ensure(ctx, js, cfg)
			if err != nil {
				t.Fatalf("Ensure: %v", err)
			}
			if !exists(t, js, tc.has) || exists(t, js, tc.hasNot) {
				t.Errorf("after Ensure: %s exists %t, %s exists %t; want only %s", tc.has, exists(t, js, tc.has), tc.hasNot, exists(t, js, tc.hasNot), tc.has)
			}
			if got := recorded(t, js); got != string(tc.want) {
				t.Errorf("recorded layout %q, want %q", got, tc.want)
			}
			if last := lines[len(lines)-1]; !strings.HasPrefix(last, "recorded layout "+string(tc.want)) {
				t.Errorf("Ensure's last line %q, want recorded layout %s…", last, tc.want)
			}
		})
	}
}

// `run --embedded` gives its own server the mapping once the partition streams are chosen: no
// probe could find it before.
func TestAutoLayoutWhenTheCallerSetsTheMapping(t *testing.T) {
	t.Parallel()
	_, js := natstest.Start(t).JetStream(t)
	cfg := autoConfig(t)
	cfg.CallerSetsMapping = true
	choice, err := setup.ChooseLayout(context.Background(), js, cfg)
	if err != nil || choice.Layout != subjects.PartitionStreams || choice.Faster != "" {
		t.Errorf("ChooseLayout with CallerSetsMapping = %+v, %v; want streams", choice, err)
	}
}

// An existing deployment keeps its layout under auto, whether setup recorded it or not (made
// before layouts were recorded), even on a server where a new one would get the other.
func TestAutoKeepsTheExistingLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		existing subjects.StreamLayout
		forget   bool
		why      string
	}{
		{subjects.SingleStream, false, "recorded in bucket kvmapper"},
		{subjects.SingleStream, true, "stream INCOMING exists"},
		{subjects.PartitionStreams, false, "recorded in bucket kvmapper"},
		{subjects.PartitionStreams, true, "stream INCOMING-0 exists"},
	} {
		name := string(tc.existing) + " recorded"
		if tc.forget {
			name = string(tc.existing) + " not recorded"
		}
		t.Run(name, func(t *testing.T) {
			lay := layout(t, 16)
			srv := mapped(t, lay)
			_, js := srv.JetStream(t)
			if _, err := setup.Ensure(ctx, js, setup.Config{Layout: lay, Names: subjects.Names{StreamLayout: tc.existing}}); err != nil {
				t.Fatal(err)
			}
			other := "INCOMING-0"
			if tc.existing == subjects.PartitionStreams {
				// A new deployment on this server would get the single stream.
				srv.GlobalAccount().RemoveMapping(lay.MappingSource())
				other = "INCOMING"
			}
			if tc.forget {
				forgetLayout(t, js)
			}
			for name, choose := range map[string]func(context.Context, jetstream.JetStream, setup.Config) (setup.LayoutChoice, error){
				"ChooseLayout": setup.ChooseLayout, "RecordedLayout": setup.RecordedLayout,
			} {
				choice, err := choose(ctx, js, autoConfig(t))
				if err != nil || choice.Layout != tc.existing || choice.Why != tc.why {
					t.Errorf("%s = %s (%q), %v; want %s (%q)", name, choice.Layout, choice.Why, err, tc.existing, tc.why)
				}
			}
			// Ensure with auto keeps the layout: with the single stream it succeeds; with the
			// partition streams on a server that lost the mapping it refuses for want of the
			// mapping, rather than making the single stream a new deployment would get.
			_, err := setup.Ensure(ctx, js, autoConfig(t))
			switch {
			case tc.existing == subjects.SingleStream && err != nil:
				t.Fatalf("Ensure with auto: %v", err)
			case tc.existing == subjects.PartitionStreams && !errors.Is(err, setup.ErrNoMapping):
				t.Errorf("Ensure with auto on the partition streams without the mapping = %v, want ErrNoMapping", err)
			}
			if exists(t, js, other) {
				t.Errorf("%s exists beside the %s layout", other, tc.existing)
			}
		})
	}
}

// A layout asked for that the record contradicts is refused, by setup and by every other
// command, naming both; once the recorded layout's streams are removed, setup moves the
// deployment and records the new layout.
func TestExplicitLayoutAgainstTheRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lay := layout(t, 16)
	_, js := mapped(t, lay).JetStream(t)
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: lay}); err != nil {
		t.Fatal(err)
	}
	streams := streamsConfig(t, 16)
	for name, run := range map[string]func() error{
		"Ensure":         func() error { _, err := setup.Ensure(ctx, js, streams); return err },
		"ChooseLayout":   func() error { _, err := setup.ChooseLayout(ctx, js, streams); return err },
		"RecordedLayout": func() error { _, err := setup.RecordedLayout(ctx, js, streams); return err },
	} {
		err := run()
		if !errors.Is(err, setup.ErrLayoutConflict) {
			t.Fatalf("%s(--layout streams) over a recorded single = %v, want ErrLayoutConflict", name, err)
		}
		for _, want := range []string{"--layout streams was asked for", "records this deployment's layout as single", "run with --layout single"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s error %q does not say %q", name, err, want)
			}
		}
	}
	if exists(t, js, "INCOMING-0") {
		t.Error("a refused --layout streams created INCOMING-0")
	}
	if c, err := setup.RecordedLayout(ctx, js, setup.Config{Layout: lay, Names: subjects.Names{StreamLayout: subjects.SingleStream}}); err != nil || c.Layout != subjects.SingleStream {
		t.Errorf("RecordedLayout(--layout single) = %+v, %v; want single", c, err)
	}

	// Moving: the single stream removed, setup --layout streams records the new layout.
	if err := js.DeleteStream(ctx, "INCOMING"); err != nil {
		t.Fatal(err)
	}
	if _, err := setup.RecordedLayout(ctx, js, streams); !errors.Is(err, setup.ErrLayoutConflict) {
		t.Errorf("RecordedLayout(--layout streams) before setup moved = %v, want ErrLayoutConflict", err)
	}
	lines, err := setup.Ensure(ctx, js, streams)
	if err != nil {
		t.Fatalf("Ensure(--layout streams) after INCOMING was removed: %v", err)
	}
	if last := lines[len(lines)-1]; !strings.Contains(last, "recorded layout streams in bucket kvmapper (key layout) in place of single") {
		t.Errorf("Ensure's last line %q, want it to say streams replaced single", last)
	}
	if c, err := setup.RecordedLayout(ctx, js, autoConfig(t)); err != nil || c.Layout != subjects.PartitionStreams {
		t.Errorf("RecordedLayout(auto) after the move = %+v, %v; want streams", c, err)
	}
}

// The commands that only read a deployment refuse to guess: with nothing recorded and no
// INCOMING they say to run setup. A recorded value that names no layout is a mismatch.
func TestRecordedLayoutNeedsADeployment(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, js := natstest.Start(t).JetStream(t)
	_, err := setup.RecordedLayout(ctx, js, autoConfig(t))
	if !errors.Is(err, setup.ErrNoLayout) || !strings.Contains(err.Error(), "run `kvmapper setup` first") {
		t.Errorf("RecordedLayout on an empty server = %v, want ErrNoLayout saying to run kvmapper setup", err)
	}
	// Direct mode keeps no INCOMING: nothing to resolve, on any server.
	direct := autoConfig(t)
	direct.Mode = wire.ModeDirect
	if c, err := setup.RecordedLayout(ctx, js, direct); err != nil || c.Layout != subjects.SingleStream {
		t.Errorf("RecordedLayout in direct mode = %+v, %v; want single, no error", c, err)
	}

	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16)}); err != nil {
		t.Fatal(err)
	}
	ctl, err := js.KeyValue(ctx, "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.PutString(ctx, wire.LayoutKey, "sharded"); err != nil {
		t.Fatal(err)
	}
	if _, err := setup.RecordedLayout(ctx, js, autoConfig(t)); !errors.Is(err, setup.ErrMismatch) || !strings.Contains(err.Error(), `holds "sharded"`) {
		t.Errorf("RecordedLayout with layout=sharded recorded = %v, want ErrMismatch quoting the value", err)
	}
}

// A direct-mode deployment, read without --mode direct (status and verify find out from the
// control bucket's mode mark): no layout to resolve, and no error before they read the mark.
func TestRecordedLayoutOfADirectModeDeployment(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, js := natstest.Start(t).JetStream(t)
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), Mode: wire.ModeDirect, Receive: wire.ReceiveAll}); err != nil {
		t.Fatal(err)
	}
	c, err := setup.RecordedLayout(ctx, js, autoConfig(t))
	if err != nil || c.Layout != subjects.SingleStream || !strings.Contains(c.Why, "marks direct mode") {
		t.Errorf("RecordedLayout(auto, stream mode) on a direct deployment = %+v, %v; want single, why … marks direct mode …", c, err)
	}
}
