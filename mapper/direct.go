package mapper

import (
	"context"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/direct"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/wire"
)

// engine maps the partitions the election hands this replica: the lanes in stream mode, the
// direct pool in direct mode. Its counters have the lanes' shape, which status and metrics read.
type engine interface {
	Run(ctx context.Context, a lanes.Assignment) error
	Stats() lanes.Stats
	Partitions() []lanes.PartitionStats
}

var _ engine = (*lanes.Pool)(nil)

// newDirect builds the pool of direct mode from the replica's configuration: the lanes' layout,
// setup's receive mode and the replica's table, whose revision and catch-up keep a group change
// where the previous owner of a partition put it (I4).
func newDirect(nc *nats.Conn, lookup direct.LookupFunc, table *kv.Table, control jetstream.KeyValue, cfg Config) (*direct.Pool, error) {
	dcfg := cfg.Direct
	dcfg.Layout = cfg.Lanes.Layout
	dcfg.Receive = wire.Receive(cfg.Setup.Receive)
	dcfg.Replica = cfg.ID
	dcfg.HandoffPrefix = "kvmapper.direct." + control.Bucket()
	dcfg.Revision, dcfg.CatchUp = table.Revision, table.CatchUp
	dcfg.Alone = alone(control, cfg.ID)
	dcfg.Logger = cfg.Logger.With().Str("component", "direct").Logger()
	return direct.New(nc, lookup, dcfg)
}

// alone reports whether no other replica's member key is in the control bucket: the replica
// leaving deletes its own key before it releases its partitions, so nobody is left to hand them
// to. A failure to read the bucket counts as not alone (the partition waits for a handoff).
func alone(control jetstream.KeyValue, id string) func(ctx context.Context) bool {
	own := wire.MemberKey(id)
	return func(ctx context.Context) bool {
		keys, err := control.ListKeysFiltered(ctx, wire.KindMember+".>")
		if err != nil {
			return false
		}
		defer func() { _ = keys.Stop() }()
		others := false
		for k := range keys.Keys() {
			if k != own {
				others = true
			}
		}
		return !others
	}
}

// directEngine shows a direct pool as an engine.
type directEngine struct{ p *direct.Pool }

func (d directEngine) Run(ctx context.Context, a lanes.Assignment) error {
	return d.p.Run(ctx, direct.Assignment{Partition: a.Partition, Epoch: a.Epoch, Valid: a.Valid})
}

// Stats has no acknowledgements to count: in direct mode they go to the devices.
func (d directEngine) Stats() lanes.Stats {
	s := d.p.Stats()
	return lanes.Stats{Mapped: s.Mapped, Unmapped: s.Unmapped, Dropped: s.Dropped, Failures: s.Failures}
}

// Partitions report what waits in each partition's queue as its lag; there are no checkpoints.
func (d directEngine) Partitions() []lanes.PartitionStats {
	ps := d.p.Partitions()
	out := make([]lanes.PartitionStats, len(ps))
	for i, p := range ps {
		out[i] = lanes.PartitionStats{Partition: p.Partition, Epoch: p.Epoch, Pending: uint64(p.Pending)}
	}
	return out
}
