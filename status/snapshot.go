package status

import (
	"time"

	"github.com/kvmapper/kvmapper/wire"
)

// Snapshot is the state of a kvmapper deployment at one moment, as [Read] assembles it.
type Snapshot struct {
	At time.Time `json:"at"`
	// Mode is what devices publish into: "stream" (INCOMING) or "direct" (no stream: each
	// partition's owner republishes what it receives to OUTGOING).
	Mode wire.Mode `json:"mode"`
	// Control is the control bucket's name: leases, members, checkpoints.
	Control    string      `json:"control"`
	Partitions []Partition `json:"partitions"`
	Replicas   []Replica   `json:"replicas"`
	Groups     Groups      `json:"groups"`
	// Incoming describes INCOMING in the single-stream layout. In the partition-streams layout
	// it sums up the partition streams (Name "<INCOMING>-<p>", Messages their total, no
	// sequences), and Streams describes each. Absent in direct mode, which has no INCOMING.
	Incoming Stream `json:"incoming,omitzero"`
	// Outputs describe OUTGOING and UNMAPPED, in direct mode only: there they are the only
	// streams the messages reach.
	Outputs []Stream `json:"outputs,omitempty"`
	// StreamLayout is how INCOMING is stored: "single" or "streams"; "" in direct mode.
	StreamLayout string `json:"stream_layout"`
	// Streams are the partition streams in partition order; empty in the single-stream layout.
	Streams []Stream `json:"streams,omitempty"`
	// Replication is how every stream kvmapper uses is replicated, in [StreamNames] order:
	// INCOMING (or each partition stream; neither in direct mode), OUTGOING, UNMAPPED, the groups
	// and control buckets.
	Replication []Replication `json:"replication"`
	// Parked describes the PARKED stream; nil when there is none (parking never turned on).
	Parked *Parked `json:"parked,omitempty"`

	parking      bool // the control bucket says the deployment parks
	markedDirect bool // the control bucket says the deployment runs in direct mode
}

// Parked is what the PARKED stream holds: the messages of devices without a group, held until
// they get one (kvmapper run --on-unmapped park), counted from the stream's per-subject index.
type Parked struct {
	Stream   string `json:"stream"`
	Messages uint64 `json:"messages"`
	Devices  int    `json:"devices"`
	// Top are the devices with the most messages parked, at most [MaxParkedShown], most first.
	Top []ParkedDevice `json:"top"`
}

// ParkedDevice is one parked device.
type ParkedDevice struct {
	Device    string `json:"device"`
	Partition int    `json:"partition"`
	Messages  uint64 `json:"messages"`
}

// MaxParkedShown is how many parked devices a snapshot lists by name.
const MaxParkedShown = 20

// Partition is one partition's owner and progress.
type Partition struct {
	Partition int    `json:"partition"`
	Owner     string `json:"owner"` // value of lease.<p>; "" when unowned
	// Epoch is the owner's fencing token (lease revision at claim), from the owner's report;
	// 0 when the owner did not answer. The lease key's revision moves with every renewal, so
	// the bucket alone does not give it: LeaseRevision is its current revision.
	Epoch         uint64 `json:"epoch"`
	LeaseRevision uint64 `json:"lease_revision"`
	// Checkpoint is checkpoint.<p>: the INCOMING sequence the partition has been republished up to.
	Checkpoint uint64 `json:"checkpoint"`
	// CheckpointIncarnation is the incarnation of INCOMING (or of the partition's stream) the
	// checkpoint was written in ("" for a checkpoint written before checkpoints named it, taken
	// as the current one's).
	CheckpointIncarnation string `json:"checkpoint_incarnation,omitempty"`
	// StaleCheckpoint is true when the checkpoint belongs to an earlier INCOMING, deleted and
	// created again since: Checkpoint is then a position in the old stream, and the partition's
	// next owner starts from the first message of the new one.
	StaleCheckpoint bool `json:"stale_checkpoint,omitempty"`
	// Acked is the owner's acknowledged prefix (ahead of Checkpoint by up to one checkpoint
	// interval); 0 when the owner did not answer.
	Acked uint64 `json:"acked"`
	// Lag is how many messages of the partition INCOMING holds past what is acknowledged.
	Lag uint64 `json:"lag"`
	// LagFrom says where Lag comes from: "replica" (the owner's report: pending + in flight),
	// "stream" (INCOMING's count of the partition's messages after Checkpoint) or "" (unknown).
	LagFrom string `json:"lag_from"`
	// ParkedDevices and ParkedMessages are what PARKED holds of the partition.
	ParkedDevices  int    `json:"parked_devices,omitempty"`
	ParkedMessages uint64 `json:"parked_messages,omitempty"`
	// Waiting is what the owner's lane has been waiting for, from the owner's report; nil when
	// nothing, or the owner did not answer.
	Waiting *Waiting `json:"waiting,omitempty"`
	// Rate is messages per second republished, between the previous snapshot and this one;
	// nil when there was no previous snapshot or the partition moved back.
	Rate *float64 `json:"rate,omitempty"`
}

// Replica is one member of the control bucket and what it reported.
type Replica struct {
	ID string `json:"id"`
	// Report is the replica's answer to its status request, nil when it did not answer.
	Report *Report `json:"report,omitempty"`
	// Error says why there is no report.
	Error string `json:"error,omitempty"`
	// Leases are the partitions whose lease.<p> names this replica.
	Leases []int `json:"leases"`
}

// Groups describes the groups bucket.
type Groups struct {
	Bucket string `json:"bucket"`
	// Values is the number of values the bucket holds (devices, plus delete markers not yet
	// purged).
	Values uint64 `json:"values"`
	// Revision is the bucket's last revision.
	Revision uint64 `json:"revision"`
}

// Stream describes INCOMING, or one partition stream.
type Stream struct {
	Name     string `json:"name"`
	Messages uint64 `json:"messages"`
	FirstSeq uint64 `json:"first_seq"`
	LastSeq  uint64 `json:"last_seq"`
	// Leader is the server that leads the stream on a cluster; "" on a single server.
	Leader string `json:"leader,omitempty"`
	// Created is when the stream was created; Incarnation names that life of it, as checkpoints
	// and Nats-Msg-Ids do.
	Created     time.Time `json:"created"`
	Incarnation string    `json:"incarnation"`
}

// position is how far the partition has got: the owner's acknowledged prefix when known, else
// its checkpoint.
func (p *Partition) position() uint64 { return max(p.Acked, p.Checkpoint) }

// SetRates fills each partition's Rate from its progress since prev. A partition whose position
// went back (a new owner reporting less than the old one acknowledged) gets no rate.
// In direct mode there is no acknowledged position to take a rate from: no partition gets one.
func (s *Snapshot) SetRates(prev *Snapshot) {
	if prev == nil || s.Mode == wire.ModeDirect {
		return
	}
	dt := s.At.Sub(prev.At).Seconds()
	if dt <= 0 {
		return
	}
	before := make(map[int]uint64, len(prev.Partitions))
	for _, p := range prev.Partitions {
		before[p.Partition] = p.position()
	}
	for i := range s.Partitions {
		p := &s.Partitions[i]
		b, ok := before[p.Partition]
		if !ok || p.position() < b {
			continue
		}
		r := float64(p.position()-b) / dt
		p.Rate = &r
	}
}
