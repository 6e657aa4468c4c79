package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"

	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
)

// replicaConfig is everything one replica needs besides its connection.
type replicaConfig struct {
	ID       string
	Setup    setup.Config
	Lanes    lanes.Config    // Layout and Incoming are required; Logger is set from Logger
	Election election.Config // ReplicaID, Partitions and Logger are set from the rest
	Logger   zerolog.Logger
}

// replica wires the components of one kvmapper replica: the groups table (kv), the lanes and the
// elector that hands partitions to the lanes.
type replica struct {
	table   *kv.Table
	pool    *lanes.Pool
	elector *election.Elector
}

// newReplica runs setup, opens the buckets and builds the components.
func newReplica(ctx context.Context, js jetstream.JetStream, cfg replicaConfig) (*replica, error) {
	log := cfg.Logger
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	lines, err := setup.Ensure(sctx, js, cfg.Setup)
	cancel()
	for _, l := range lines {
		log.Debug().Msg(l)
	}
	if err != nil {
		return nil, err
	}
	groups, err := js.KeyValue(ctx, cfg.Setup.Groups)
	if err != nil {
		return nil, fmt.Errorf("opening bucket %s: %w", cfg.Setup.Groups, err)
	}
	control, err := js.KeyValue(ctx, cfg.Setup.Control)
	if err != nil {
		return nil, fmt.Errorf("opening bucket %s: %w", cfg.Setup.Control, err)
	}
	table, err := kv.New(groups, kv.Config{Logger: log.With().Str("component", "kv").Logger()})
	if err != nil {
		return nil, err
	}
	lcfg := cfg.Lanes
	lcfg.Logger = log.With().Str("component", "lanes").Logger()
	pool, err := lanes.New(js, control, func(device string) (string, uint64, string) {
		e, ok := table.Lookup(device)
		if !ok {
			return "", 0, lanes.ReasonNoMapping
		}
		return e.Group, e.Revision, e.Reason
	}, lcfg)
	if err != nil {
		return nil, asUsage(err, lanes.ErrInvalidConfig)
	}
	ecfg := cfg.Election
	ecfg.ReplicaID = cfg.ID
	ecfg.Partitions = lcfg.Layout.Partitions
	ecfg.Logger = log.With().Str("component", "election").Logger()
	if ecfg.ReleaseTimeout == 0 {
		// A releasing lane may wait DrainTimeout for acknowledgements, then write a checkpoint.
		ecfg.ReleaseTimeout = pool.DrainTimeout() + 10*time.Second
	}
	elector, err := election.New(js, control, func(ctx context.Context, l *election.Lease) error {
		return pool.Run(ctx, lanes.Assignment{Partition: l.Partition, Epoch: l.Epoch, Valid: l.Valid})
	}, ecfg)
	if err != nil {
		return nil, asUsage(err, election.ErrInvalidConfig)
	}
	return &replica{table: table, pool: pool, elector: elector}, nil
}

// Run loads the groups table, calls ready once it is loaded, then takes part in the election
// until ctx is done, when it hands its partitions over. It returns when every component has
// stopped; nil after a clean stop.
func (r *replica) Run(ctx context.Context, ready func()) error {
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return r.table.Run(gctx) })
	g.Go(func() error {
		select {
		case <-r.table.Ready():
		case <-gctx.Done():
			return nil
		}
		if ready != nil {
			ready()
		}
		return r.elector.Run(gctx)
	})
	err := g.Wait()
	if err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// asUsage makes err a usage error (exit code 2) when it wraps sentinel: a configuration built
// from flags that the component refused.
func asUsage(err, sentinel error) error {
	if errors.Is(err, sentinel) {
		return usageError{err}
	}
	return err
}
