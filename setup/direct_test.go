package setup_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/wire"
)

func directConfig(t *testing.T, partitions int, r wire.Receive) setup.Config {
	return setup.Config{Layout: layout(t, partitions), Mode: wire.ModeDirect, Receive: r}
}

// Direct mode creates no INCOMING, and says what the server does with the device subjects.
func TestDirectModeCreatesNoIncoming(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		receive wire.Receive
		mapped  bool
		want    string
	}{
		{wire.ReceiveMapping, true, "direct mode: no stream captures incoming.*.*; the account mapping incoming.*.* → incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}} delivers every partition (probed)"},
		{wire.ReceiveAll, false, "direct mode: no stream captures incoming.*.*, and the server does not map it: every replica receives every device subject and keeps its partitions (probed)"},
	} {
		t.Run(string(c.receive), func(t *testing.T) {
			cfg := directConfig(t, 16, c.receive)
			srv := natstest.Start(t)
			if c.mapped {
				srv = mapped(t, cfg.Layout)
			}
			_, js := srv.JetStream(t)
			lines, err := setup.Ensure(ctx, js, cfg)
			if err != nil {
				t.Fatalf("Ensure: %v", err)
			}
			if len(lines) != 5 || lines[0] != c.want {
				t.Fatalf("Ensure reported %q, want 5 lines starting with %q", lines, c.want)
			}
			if _, err := js.Stream(ctx, "INCOMING"); !errors.Is(err, jetstream.ErrStreamNotFound) {
				t.Errorf("Stream(INCOMING) = %v, want not found in direct mode", err)
			}
			for _, s := range []string{"OUTGOING", "UNMAPPED"} {
				if _, err := js.Stream(ctx, s); err != nil {
					t.Errorf("Stream(%s): %v", s, err)
				}
			}
		})
	}
}

// Without the mapping, direct mode with the default receive mode refuses and prints the mapping
// block to add, or the way around it.
func TestDirectModeNeedsTheMapping(t *testing.T) {
	t.Parallel()
	cfg := directConfig(t, 16, wire.ReceiveMapping)
	_, js := natstest.Start(t).JetStream(t)
	_, err := setup.Ensure(context.Background(), js, cfg)
	if !errors.Is(err, setup.ErrNoMapping) {
		t.Fatalf("Ensure without the mapping = %v, want ErrNoMapping", err)
	}
	for _, want := range []string{
		"arrived unchanged: the account has no mapping",
		"mappings {\n  \"incoming.*.*\": \"incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}\"\n}",
		`nsc add mapping --account <ACCOUNT> --from "incoming.*.*"`,
		"--direct-receive all",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q:\n%v", want, err)
		}
	}
}

// A mapping for another partition count is named as such.
func TestDirectModeRefusesAnotherPartitionCount(t *testing.T) {
	t.Parallel()
	srv := mapped(t, layout(t, 8))
	_, js := srv.JetStream(t)
	_, err := setup.Ensure(context.Background(), js, directConfig(t, 16, wire.ReceiveMapping))
	if !errors.Is(err, setup.ErrNoMapping) || !strings.Contains(err.Error(), "wrong partition") {
		t.Fatalf("Ensure with a mapping of 8 partitions = %v, want ErrNoMapping naming the wrong partition", err)
	}
}

// Receiving every device subject needs the server not to map them: mapped, no replica
// subscribed to incoming.*.* would receive anything.
func TestDirectReceiveAllRefusesTheMapping(t *testing.T) {
	t.Parallel()
	cfg := directConfig(t, 16, wire.ReceiveAll)
	_, js := mapped(t, cfg.Layout).JetStream(t)
	_, err := setup.Ensure(context.Background(), js, cfg)
	if !errors.Is(err, setup.ErrMismatch) || !strings.Contains(err.Error(), "--direct-receive mapping") {
		t.Fatalf("Ensure = %v, want ErrMismatch pointing to --direct-receive mapping", err)
	}
}

// A stream that captures the device subjects (stream mode's INCOMING, or any other) would
// answer the devices instead of OUTGOING: direct mode refuses it and says what to do.
func TestDirectModeRefusesAStreamCapturingTheDevices(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, subject := range map[string]string{"INCOMING": "incoming.*.*", "TAP": "incoming.>", "MAPPED": "incoming.3.*.*"} {
		t.Run(name, func(t *testing.T) {
			cfg := directConfig(t, 16, wire.ReceiveMapping)
			_, js := mapped(t, cfg.Layout).JetStream(t)
			if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}}); err != nil {
				t.Fatal(err)
			}
			_, err := setup.Ensure(ctx, js, cfg)
			if !errors.Is(err, setup.ErrMismatch) {
				t.Fatalf("Ensure beside stream %s capturing %s = %v, want ErrMismatch", name, subject, err)
			}
			for _, want := range []string{"stream " + name + " captures what devices publish", "nats stream rm " + name, "without --mode direct"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error does not say %q: %v", want, err)
				}
			}
		})
	}
}

// An unknown mode or receive kind is a configuration setup refuses (wire.ParseMode and
// wire.ParseReceive read the names themselves).
func TestEnsureRefusesAnUnknownModeOrReceive(t *testing.T) {
	t.Parallel()
	for _, cfg := range []setup.Config{{Layout: layout(t, 16), Mode: "fast"}, {Layout: layout(t, 16), Mode: wire.ModeDirect, Receive: "any"}} {
		if _, err := setup.Ensure(context.Background(), nil, cfg); !errors.Is(err, setup.ErrInvalidConfig) || !errors.Is(err, wire.ErrInvalid) {
			t.Errorf("Ensure with mode %q, receive %q = %v, want ErrInvalidConfig and wire.ErrInvalid", cfg.Mode, cfg.Receive, err)
		}
	}
}

// Direct mode marks the control bucket (key mode) for status and verify, which have no INCOMING
// to read then; stream mode removes the mark.
func TestDirectModeMarksTheControlBucket(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, js := natstest.Start(t).JetStream(t)
	mode := func() string {
		t.Helper()
		ctl, err := js.KeyValue(ctx, "kvmapper")
		if err != nil {
			t.Fatal(err)
		}
		e, err := ctl.Get(ctx, "mode")
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return "(none)"
		}
		if err != nil {
			t.Fatalf("Get(mode): %v", err)
		}
		return string(e.Value())
	}
	ensure := func(cfg setup.Config) string {
		t.Helper()
		lines, err := setup.Ensure(ctx, js, cfg)
		if err != nil {
			t.Fatalf("Ensure(%s): %v", cfg.Mode, err)
		}
		// The control bucket's line: in stream mode the recorded layout's line follows it.
		for _, l := range slices.Backward(lines) {
			if strings.HasPrefix(l, "bucket kvmapper") || strings.HasPrefix(l, "created bucket kvmapper") {
				return l
			}
		}
		return lines[len(lines)-1]
	}

	if got := ensure(directConfig(t, 16, wire.ReceiveAll)); got != "created bucket kvmapper (leases, members, checkpoints); marked as direct mode (key mode)" {
		t.Errorf("Ensure(direct) on an empty server reported %q for the control bucket, want it created and marked", got)
	}
	if got := mode(); got != "direct" {
		t.Errorf("control bucket key mode = %q after Ensure(direct), want direct", got)
	}
	if got := ensure(directConfig(t, 16, wire.ReceiveAll)); got != "bucket kvmapper ok" {
		t.Errorf("Ensure(direct) again reported %q, want the bucket ok and nothing written", got)
	}
	if got := ensure(setup.Config{Layout: layout(t, 16)}); got != "bucket kvmapper ok; its direct mode mark removed (key mode): stream mode" {
		t.Errorf("Ensure(stream) after direct reported %q, want the mark removed", got)
	}
	if got := mode(); got != "(none)" {
		t.Errorf("control bucket key mode = %q after Ensure(stream), want none", got)
	}
	if got := ensure(setup.Config{Layout: layout(t, 16)}); got != "bucket kvmapper ok" {
		t.Errorf("Ensure(stream) again reported %q, want the bucket ok", got)
	}
}
