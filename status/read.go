package status

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// ReadConfig says where [Read] looks. Zero fields mean the defaults given.
type ReadConfig struct {
	// Layout gives the partition count and INCOMING's per-partition filter. Required.
	Layout *subjects.Layout
	// Names are the streams and buckets read (Incoming with its stream layout, Groups,
	// Control); empty ones get subjects.DefaultNames.
	subjects.Names
	// Timeout bounds the wait for the replicas' status replies and for each stream's
	// replication. Default 1s.
	Timeout time.Duration
	// NoStreamLag skips counting lag in INCOMING for partitions whose owner did not report:
	// the count needs a short-lived consumer per such partition (see [Read]).
	NoStreamLag bool
	// Direct reads the deployment as one in direct mode even if the control bucket does not
	// say so ([wire.ModeKey]): see [Read].
	Direct bool
}

func (c *ReadConfig) setDefaults() error {
	if c.Layout == nil {
		return fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	c.Names = c.Names.WithDefaults()
	if c.Timeout == 0 {
		c.Timeout = time.Second
	}
	if c.Timeout < 0 {
		return fmt.Errorf("%w: negative timeout", ErrInvalidConfig)
	}
	return nil
}

// Read assembles a snapshot from NATS alone, so it works from any machine that can reach the
// servers. It reads the control bucket (leases, members, checkpoints), asks every member for its
// [Report] on [StatusSubject] and every stream for its [Replication] at once (waiting up to
// Timeout), and reads the state of INCOMING
// (or of every partition stream) and the groups bucket. A partition's lag comes from its owner's report; for a partition whose
// owner did not report (or that has none) it is counted in INCOMING after its checkpoint, by
// creating an ephemeral consumer filtered on the partition that starts after the checkpoint and
// reading its pending count (one consumer create and delete per such partition; the server
// counts from its per-subject index, so this stays cheap with many devices).
// A member that does not answer is listed with Error set; Read fails only when NATS does.
//
// In direct mode (the control bucket holds [wire.ModeKey], or Direct is set) there is no
// INCOMING: Read reads OUTGOING's and UNMAPPED's state instead ([Snapshot].Outputs), takes each
// partition's lag from its owner's report alone (what waits in its queue) and reads no
// checkpoints, which direct mode does not write.
func Read(ctx context.Context, js jetstream.JetStream, cfg ReadConfig) (*Snapshot, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	n := cfg.Layout.Partitions
	ctl, err := js.KeyValue(ctx, cfg.Control)
	if err != nil {
		return nil, fmt.Errorf("status: opening bucket %s: %w", cfg.Control, err)
	}
	snap := &Snapshot{Control: cfg.Control, Partitions: make([]Partition, n)}
	for p := range snap.Partitions {
		snap.Partitions[p].Partition = p
	}
	members, err := readControl(ctx, ctl, snap)
	if err != nil {
		return nil, err
	}
	snap.At = time.Now()
	snap.Mode = wire.ModeStream
	if cfg.Direct || snap.markedDirect {
		snap.Mode = wire.ModeDirect
		for i := range snap.Partitions {
			p := &snap.Partitions[i]
			p.Checkpoint, p.CheckpointIncarnation = 0, "" // an earlier deployment's, in stream mode
		}
	}
	direct := snap.Mode == wire.ModeDirect
	streamNames := StreamNames(cfg.Names, n)
	if direct {
		streamNames = streamNames[len(cfg.IncomingStreams(n)):]
	}

	// Ask the members and the streams' leaders, and meanwhile read the stream and bucket
	// states.
	var replies map[string]reply
	var wg sync.WaitGroup
	wg.Go(func() { replies = ask(ctx, js.Conn(), cfg, members) })
	wg.Go(func() {
		snap.Replication = ReadReplication(ctx, js, streamNames, cfg.Timeout)
		for i, r := range snap.Replication {
			if r.Stream == cfg.Outgoing || r.Stream == cfg.Unmapped || r.Stream == cfg.Parked {
				if r.Stream == cfg.Parked && r.mode == "batch" {
					r.mode = "single" // parking needs each park's sequence (package lanes)
				}
				snap.Replication[i].WriteMode = r.mode
			}
		}
	})
	defer wg.Wait()
	var streams []jetstream.Stream
	if direct {
		if snap.Outputs, err = readOutputs(ctx, js, cfg); err != nil {
			return nil, err
		}
	} else {
		if streams, err = readIncoming(ctx, js, cfg, snap); err != nil {
			return nil, err
		}
		for i := range snap.Partitions {
			p := &snap.Partitions[i]
			p.StaleCheckpoint = p.CheckpointIncarnation != "" && p.CheckpointIncarnation != snap.streamOf(p.Partition).Incarnation
		}
	}
	if snap.Groups, err = readGroups(ctx, js, cfg.Groups); err != nil {
		return nil, err
	}
	if err := readParked(ctx, js, cfg, snap); err != nil {
		return nil, err
	}

	wg.Wait()
	byID := map[string]*Report{}
	for _, id := range members {
		r := replies[id]
		rep := Replica{ID: id, Report: r.report, Leases: []int{}}
		if r.err != nil {
			rep.Error = r.err.Error()
		} else {
			byID[id] = r.report
		}
		snap.Replicas = append(snap.Replicas, rep)
	}
	for i := range snap.Partitions {
		p := &snap.Partitions[i]
		if p.Owner == "" {
			continue
		}
		for j := range snap.Replicas {
			if snap.Replicas[j].ID == p.Owner {
				snap.Replicas[j].Leases = append(snap.Replicas[j].Leases, p.Partition)
			}
		}
		r, ok := byID[p.Owner]
		if !ok {
			continue
		}
		for _, pr := range r.Partitions {
			if pr.Partition == p.Partition {
				p.Epoch, p.Acked, p.Lag, p.LagFrom = pr.Epoch, pr.Acked, pr.Lag, "replica"
				p.Waiting = pr.Waiting
			}
		}
	}
	if !cfg.NoStreamLag && !direct {
		if err := streamLag(ctx, streams, cfg, snap); err != nil {
			return nil, err
		}
	}
	return snap, nil
}

// readControl fills owners and checkpoints from the control bucket and returns the member ids,
// sorted. It reads the bucket with one watch rather than a Get per key.
func readControl(ctx context.Context, ctl jetstream.KeyValue, snap *Snapshot) ([]string, error) {
	w, err := ctl.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return nil, fmt.Errorf("status: reading bucket %s: %w", ctl.Bucket(), err)
	}
	defer func() { _ = w.Stop() }()
	var members []string
	n := len(snap.Partitions)
	for {
		var e jetstream.KeyValueEntry
		select {
		case e = <-w.Updates():
		case <-ctx.Done():
			return nil, fmt.Errorf("status: reading bucket %s: %w", ctl.Bucket(), ctx.Err())
		}
		if e == nil {
			break
		}
		switch e.Key() {
		case wire.ParkedKey:
			snap.parking = true
		case wire.ModeKey:
			snap.markedDirect = wire.MarksDirect(e.Value())
		}
		kind, p, id, ok := wire.ParseControlKey(e.Key())
		if kind == wire.KindMember {
			members = append(members, id)
			continue
		}
		if !ok || p >= n {
			continue
		}
		switch kind {
		case wire.KindLease:
			snap.Partitions[p].Owner = string(e.Value())
			snap.Partitions[p].LeaseRevision = e.Revision()
		case wire.KindCheckpoint:
			if cp, err := wire.ParseCheckpoint(e.Value()); err == nil {
				snap.Partitions[p].Checkpoint, snap.Partitions[p].CheckpointIncarnation = cp.Seq, cp.Incarnation
			}
		}
	}
	slices.Sort(members)
	return slices.Compact(members), nil
}

type reply struct {
	report *Report
	err    error
}

// ask requests every member's report at once and returns the replies when all have answered
// or timed out.
func ask(ctx context.Context, nc *nats.Conn, cfg ReadConfig, members []string) map[string]reply {
	chans := make(map[string]chan reply, len(members))
	var wg sync.WaitGroup
	for _, id := range members {
		ch := make(chan reply, 1)
		chans[id] = ch
		wg.Go(func() {
			rctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
			defer cancel()
			m, err := nc.RequestWithContext(rctx, StatusSubject(cfg.Control, id), nil)
			if err != nil {
				if errors.Is(err, nats.ErrNoResponders) {
					err = errors.New("no status endpoint (replica stopped, or older than this command)")
				}
				ch <- reply{err: err}
				return
			}
			var r Report
			if err := json.Unmarshal(m.Data, &r); err != nil {
				ch <- reply{err: fmt.Errorf("bad status reply: %w", err)}
				return
			}
			ch <- reply{report: &r}
		})
	}
	wg.Wait()
	out := make(map[string]reply, len(members))
	for id, ch := range chans {
		out[id] = <-ch
	}
	return out
}

// readIncoming reads the state of every stream holding INCOMING messages into snap and returns
// them, in partition order.
func readIncoming(ctx context.Context, js jetstream.JetStream, cfg ReadConfig, snap *Snapshot) ([]jetstream.Stream, error) {
	snap.StreamLayout = string(cfg.StreamLayout)
	var streams []jetstream.Stream
	var states []Stream
	for _, name := range cfg.IncomingStreams(cfg.Layout.Partitions) {
		s, st, err := readStream(ctx, js, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, fmt.Errorf("%w (in direct mode there is none: a replica or `kvmapper setup` run with --mode direct marks the control bucket %s so, which status reads; or pass --mode direct)",
				err, cfg.Control)
		}
		if err != nil {
			return nil, err
		}
		streams, states = append(streams, s), append(states, st)
	}
	if cfg.StreamLayout != subjects.PartitionStreams {
		snap.Incoming = states[0]
		return streams, nil
	}
	snap.Streams = states
	snap.Incoming = Stream{Name: cfg.Incoming + "-<p>"}
	for _, st := range states {
		snap.Incoming.Messages += st.Messages
	}
	return streams, nil
}

// readStream opens stream name and returns it with its state.
func readStream(ctx context.Context, js jetstream.JetStream, name string) (jetstream.Stream, Stream, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return nil, Stream{}, fmt.Errorf("status: opening stream %s: %w", name, err)
	}
	si, err := s.Info(ctx)
	if err != nil {
		return nil, Stream{}, fmt.Errorf("status: reading stream %s: %w", name, err)
	}
	st := Stream{Name: name, Messages: si.State.Msgs, FirstSeq: si.State.FirstSeq, LastSeq: si.State.LastSeq,
		Created: si.Created, Incarnation: wire.Incarnation(si.Created)}
	if si.Cluster != nil {
		st.Leader = si.Cluster.Leader
	}
	return s, st, nil
}

// readOutputs returns the state of OUTGOING and UNMAPPED.
func readOutputs(ctx context.Context, js jetstream.JetStream, cfg ReadConfig) ([]Stream, error) {
	var out []Stream
	for _, name := range []string{cfg.Outgoing, cfg.Unmapped} {
		_, st, err := readStream(ctx, js, name)
		if err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	return out, nil
}

// readParked counts PARKED's messages per device, if the deployment parks (the control bucket
// holds wire.ParkedKey) and the stream exists.
func readParked(ctx context.Context, js jetstream.JetStream, cfg ReadConfig, snap *Snapshot) error {
	if !snap.parking {
		return nil
	}
	s, err := js.Stream(ctx, cfg.Parked)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("status: opening stream %s: %w", cfg.Parked, err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(cfg.ParkedPrefix+".>"))
	if err != nil {
		return fmt.Errorf("status: reading stream %s: %w", cfg.Parked, err)
	}
	// The stream's own count would take in the fence records PARKED holds beside the parked
	// messages (kvmapper.fence.PARKED.>): count what the parked subjects hold.
	pk := &Parked{Stream: cfg.Parked, Top: []ParkedDevice{}}
	var all []ParkedDevice
	for subj, n := range info.State.Subjects {
		device, p, ok := subjects.ParkedDevice(cfg.ParkedPrefix, subj)
		if !ok || n == 0 {
			continue
		}
		pk.Messages += n
		all = append(all, ParkedDevice{Device: device, Partition: p, Messages: n})
		if p < len(snap.Partitions) {
			snap.Partitions[p].ParkedDevices++
			snap.Partitions[p].ParkedMessages += n
		}
	}
	pk.Devices = len(all)
	slices.SortFunc(all, func(a, b ParkedDevice) int {
		if a.Messages != b.Messages {
			return cmp.Compare(b.Messages, a.Messages)
		}
		return strings.Compare(a.Device, b.Device)
	})
	pk.Top = append(pk.Top, all[:min(len(all), MaxParkedShown)]...)
	snap.Parked = pk
	return nil
}

// streamOf returns the stream holding partition p: INCOMING, or its partition stream.
func (s *Snapshot) streamOf(p int) *Stream {
	if len(s.Streams) > p {
		return &s.Streams[p]
	}
	return &s.Incoming
}

func readGroups(ctx context.Context, js jetstream.JetStream, bucket string) (Groups, error) {
	g := Groups{Bucket: bucket}
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return g, fmt.Errorf("status: opening bucket %s: %w", bucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return g, fmt.Errorf("status: reading bucket %s: %w", bucket, err)
	}
	g.Values = st.Values()
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok {
		g.Revision = bs.StreamInfo().State.LastSeq
	}
	return g, nil
}

// streamLag counts, for each partition without a lag from its owner, the messages of the
// partition in its stream after its checkpoint. streams are the streams holding INCOMING
// messages, in partition order (one in the single-stream layout).
func streamLag(ctx context.Context, streams []jetstream.Stream, cfg ReadConfig, snap *Snapshot) error {
	for i := range snap.Partitions {
		p := &snap.Partitions[i]
		if p.LagFrom != "" {
			continue
		}
		from := p.Checkpoint
		if p.StaleCheckpoint {
			from = 0 // its next owner starts from the new stream's first message
		}
		st := snap.streamOf(p.Partition)
		if from >= st.LastSeq {
			p.Lag, p.LagFrom = 0, "stream"
			continue
		}
		stream := streams[min(p.Partition, len(streams)-1)]
		_, filter := cfg.IncomingStream(cfg.Layout, p.Partition)
		n, err := pendingAfter(ctx, stream, filter, from)
		if err != nil {
			return fmt.Errorf("status: counting partition %d in %s: %w", p.Partition, st.Name, err)
		}
		p.Lag, p.LagFrom = n, "stream"
	}
	return nil
}

// pendingAfter returns how many messages on filter ("" for all) the stream holds after
// sequence seq.
func pendingAfter(ctx context.Context, stream jetstream.Stream, filter string, seq uint64) (uint64, error) {
	c, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Description:       "kvmapper status: lag count",
		FilterSubject:     filter,
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       seq + 1,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: 10 * time.Second,
	})
	if err != nil {
		return 0, err
	}
	info := c.CachedInfo()
	// The consumer also goes away by itself after InactiveThreshold if this delete fails.
	_ = stream.DeleteConsumer(context.WithoutCancel(ctx), info.Name)
	return info.NumPending, nil
}
