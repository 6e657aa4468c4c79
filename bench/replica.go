package bench

import (
	"context"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/mapper"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// RunReplica runs one kvmapper replica named id in this process, wired as `kvmapper run` wires
// one ([mapper.New]) with run's defaults, on a connection of its own to url: it creates or
// verifies the streams and buckets of n, calls ready (if not nil) once its groups table is
// loaded, and maps until ctx is done, when it hands its partitions over and returns (nil after
// a clean stop).
func RunReplica(ctx context.Context, log zerolog.Logger, url, id string, n Names, ready func()) error {
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", n.Partitions)
	if err != nil {
		return err
	}
	// The options of kvmapper run that matter to the mapping; the bench's server needs no
	// authentication.
	nc, err := nats.Connect(url, nats.Name("kvmapper bench "+id), nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	// The control plane on a connection of its own, as kvmapper run dials it.
	cnc, err := nats.Connect(url, nats.Name("kvmapper bench "+id+" control"), nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		return err
	}
	defer cnc.Close()
	control, err := jetstream.New(cnc)
	if err != nil {
		return err
	}
	scfg := setup.Config{Layout: lay, Names: n.Names, Replicas: n.StreamReplicas}
	scfg.Defaults()
	r, err := mapper.New(ctx, js, mapper.Config{
		ID:      id,
		Control: control,
		Setup:   scfg,
		Lanes:   lanes.Config{Layout: lay, Incoming: n.Incoming, NoProvenance: n.NoProvenance},
		Logger:  log.With().Str("replica", id).Logger(),
	})
	if err != nil {
		return err
	}
	return r.Run(ctx, ready)
}
