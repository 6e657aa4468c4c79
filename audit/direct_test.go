package audit_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// TestDirectModeIsRefused audits a deployment that setup made in direct mode: there is no
// INCOMING, and Run must refuse with ErrDirectMode and say what to check instead, rather than
// fail on a missing stream.
func TestDirectModeIsRefused(t *testing.T) {
	t.Parallel()
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	_, js := natstest.Start(t).JetStream(t)
	ctx := context.Background()
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: lay, Mode: wire.ModeDirect, Receive: wire.ReceiveAll}); err != nil {
		t.Fatalf("setup.Ensure(direct): %v", err)
	}
	rep, err := audit.Run(ctx, js, audit.Config{Layout: lay})
	if !errors.Is(err, audit.ErrDirectMode) {
		t.Fatalf("Run() in direct mode = %+v, %v; want ErrDirectMode", rep, err)
	}
	t.Logf("Run() = %v", err)
	for _, want := range []string{"(key mode of the control bucket kvmapper says so)", "PubAcks", "same Nats-Msg-Id", "OUTGOING's deduplication", "kvmapper status"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Run()'s error does not say %q: %v", want, err)
		}
	}
}

// TestDirectConfigIsRefused refuses at once when told the deployment runs in direct mode
// (`kvmapper verify --mode direct`), even where INCOMING exists.
func TestDirectConfigIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.in("dev-1")
	_, err := audit.Run(context.Background(), e.js, audit.Config{Layout: e.lay, Direct: true})
	if !errors.Is(err, audit.ErrDirectMode) || !strings.Contains(err.Error(), "PubAcks") {
		t.Fatalf("Run(Direct) = %v, want ErrDirectMode saying what to check instead", err)
	}
}
