package audit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// Kinds of [Finding].
const (
	// KindReorder: a device's message stored after one with a higher INCOMING sequence in the
	// same stream (I1).
	KindReorder = "reorder"
	// KindDuplicate: an INCOMING sequence stored a second time, in the same output stream or in
	// the other one (I2).
	KindDuplicate = "duplicate"
	// KindMissing: an INCOMING sequence of the audited range found in neither output (I2).
	KindMissing = "missing"
	// KindStaleEpoch: a message of a partition stored after one of the same partition with a
	// higher lease epoch, in the same stream: a deposed owner's write landed (I3).
	KindStaleEpoch = "stale-epoch"
	// KindForeign: a message whose Nats-Msg-Id is absent or does not name an INCOMING sequence
	// ("<Incoming>:<seq>"). Someone other than kvmapper published it; it does not fail the audit.
	KindForeign = "foreign"
	// KindMapping: a message of OUTGOING whose subject or output headers are not what the value
	// it was mapped with (the revision of the groups bucket its KVMapper-Prov names) renders
	// with the templates, or whose revision is not a usable value of its device.
	KindMapping = "mapping"
)

// kinds lists the kinds in the order findings are reported.
var kinds = [...]string{KindMissing, KindDuplicate, KindReorder, KindStaleEpoch, KindMapping, KindForeign}

// Config says what [Run] audits. Zero fields mean the defaults given.
type Config struct {
	// Layout is required: where the device token sits in output subjects, and the templates
	// (out and headers) each OUTGOING message is checked against with the value it was mapped with.
	Layout *subjects.Layout
	// Names are the streams read, the groups bucket whose revisions the mapping check reads, and
	// the control bucket, whose creation time tells epochs that started again with a re-created
	// bucket from a deposed owner's write; empty ones get subjects.DefaultNames.
	subjects.Names
	// Wait, when positive and messages are missing after the outputs have been read up to their
	// last sequence at the start, keeps consuming both outputs (continuing where it stopped) until
	// nothing is missing or Wait has passed: for a mapper that is still catching up.
	Wait time.Duration
	// MaxFindings is how many example findings are kept per kind. Default 20; negative keeps none.
	MaxFindings int
	// Progress, if set, is called with the number of output messages read so far, about every
	// 64k messages and once at the end. Calls are serialised; it must not block for long.
	Progress func(read uint64)
	// Direct says the deployment runs in direct mode: Run refuses at once with [ErrDirectMode].
	// Without it, Run refuses so when INCOMING does not exist and the control bucket says direct
	// mode ([wire.ModeKey]).
	Direct bool
}

// Finding is one example of something wrong (or foreign) in the outputs.
type Finding struct {
	Kind   string `json:"kind"`             // one of the Kind constants
	Device string `json:"device,omitempty"` // from the output subject, or the INCOMING subject for missing
	// Seq is the INCOMING sequence the message carries in Nats-Msg-Id (for missing: the one not
	// found). Zero for foreign messages.
	Seq       uint64 `json:"seq,omitempty"`
	Stream    string `json:"stream"`     // the stream holding the message (INCOMING for missing)
	StreamSeq uint64 `json:"stream_seq"` // its sequence in Stream
	Detail    string `json:"detail"`     // one line, for people
}

// Report is the result of [Run]. Counts count every occurrence; Findings holds up to
// [Config.MaxFindings] examples per kind, missing first, then duplicate, reorder, stale-epoch and
// foreign, each in the order found.
type Report struct {
	// Incoming counts the INCOMING messages audited: FirstSeq..LastSeq of each stream holding
	// them when Run started, minus the sequences deleted then.
	Incoming uint64 `json:"incoming"`
	// IncomingFirst and IncomingLast are the audited range of INCOMING in the single-stream
	// layout; 0 in the partition-streams layout, whose ranges are in Ranges.
	IncomingFirst uint64 `json:"incoming_first"`
	IncomingLast  uint64 `json:"incoming_last"`
	// Ranges are the audited ranges of each stream holding INCOMING messages: INCOMING alone,
	// or every partition stream in partition order.
	Ranges   []Range `json:"ranges"`
	Outgoing uint64  `json:"outgoing"` // messages read from OUTGOING
	Unmapped uint64  `json:"unmapped"` // messages read from UNMAPPED
	// Parked counts audited messages found in neither output but held in PARKED: their device
	// has no group yet (kvmapper run --on-unmapped park). They are not missing.
	Parked uint64 `json:"parked"`
	// OutOfRange counts messages read whose INCOMING sequence lies outside the audited range
	// (older than FirstSeq, e.g. trimmed by INCOMING's limits, or newer than LastSeq). They are
	// checked for order and epoch, but a duplicate among them is found only when it follows the
	// other copy directly in the same device's order.
	OutOfRange  uint64 `json:"out_of_range"`
	Devices     int    `json:"devices"` // distinct devices seen in the outputs
	Reorders    uint64 `json:"reorders"`
	Duplicates  uint64 `json:"duplicates"`
	Missing     uint64 `json:"missing"`
	StaleEpochs uint64 `json:"stale_epochs"`
	// Mappings counts the OUTGOING messages that do not match the value they were mapped with
	// (KindMapping). MappingChecked counts those checked, MappingUnchecked those that could not
	// be: no revision in KVMapper-Prov (provenance off), or a revision the groups bucket no longer holds
	// (its history keeps --groups-history values per key).
	Mappings         uint64 `json:"mappings"`
	MappingChecked   uint64 `json:"mapping_checked"`
	MappingUnchecked uint64 `json:"mapping_unchecked"`
	// MappingOff says why messages were not checked against their values from some point on
	// (the groups bucket could not be read), or is empty.
	MappingOff string        `json:"mapping_off,omitempty"`
	Foreign    uint64        `json:"foreign"`
	Findings   []Finding     `json:"findings"`
	Elapsed    time.Duration `json:"elapsed_ns"`
}

// OK reports whether the audit found no reorder, duplicate, missing message, stale epoch or
// message that does not match its value. Foreign messages do not count against it: they are not
// the mapper's.
func (r *Report) OK() bool {
	return r.Reorders == 0 && r.Duplicates == 0 && r.Missing == 0 && r.StaleEpochs == 0 && r.Mappings == 0
}

// Run audits the outputs against INCOMING and returns the report; it returns an error only when
// it could not complete the audit (a stream missing, a lost connection, ctx done), or one
// wrapping [ErrDirectMode] for a deployment in direct mode, which has no INCOMING.
//
// It takes INCOMING's state first (FirstSeq..LastSeq and the deleted sequences), then reads
// OUTGOING and then UNMAPPED with ordered consumers from their first message up to their last
// sequence at the time each is opened, headers only. With [Config.Wait] it then follows both.
// When messages are still missing, it reads PARKED (Names.Parked), if it exists: what it holds is
// parked, not missing (see [Report].Parked).
// Memory is one bit per sequence of INCOMING's range (two if it had interior deletes), one
// entry per device per output and one per partition: about 125 MB per billion INCOMING
// sequences, independent of message sizes. Run blocks until done and starts no goroutine that
// outlives it; it is safe to call concurrently.
func Run(ctx context.Context, js jetstream.JetStream, cfg Config) (*Report, error) {
	start := time.Now()
	if cfg.Layout == nil {
		return nil, fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	cfg.Names = cfg.Names.WithDefaults()
	if cfg.MaxFindings == 0 {
		cfg.MaxFindings = 20
	}
	cfg.MaxFindings = max(cfg.MaxFindings, 0)
	if cfg.Wait < 0 {
		return nil, fmt.Errorf("%w: Wait %v is negative", ErrInvalidConfig, cfg.Wait)
	}
	if cfg.Direct {
		return nil, directMode(cfg, "")
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	a, err := snapshot(ctx, js, cfg)
	if err != nil {
		return nil, err
	}
	found, allFound := context.WithCancel(ctx)
	defer allFound()
	a.allFound = allFound

	out, err := a.open(ctx, js, cfg.Outgoing, cfg.Layout.Out, "")
	if err != nil {
		return nil, err
	}
	defer out.stop()
	out.mapping = newMappingCheck(ctx, js, cfg.Layout, cfg.Groups)
	unm, err := a.open(ctx, js, cfg.Unmapped, cfg.Layout.Unmapped, cfg.Layout.MalformedSubject())
	if err != nil {
		return nil, err
	}
	defer unm.stop()

	// One output after the other, so that the copy reported as the duplicate is always the later
	// one in the order OUTGOING, UNMAPPED.
	if err := out.catchUp(ctx); err != nil {
		return nil, err
	}
	if err := unm.catchUp(ctx); err != nil {
		return nil, err
	}
	if cfg.Wait > 0 && a.missing.Load() > 0 {
		wctx, wcancel := context.WithTimeout(found, cfg.Wait)
		// One reader failing stops the other at once rather than at the end of the wait.
		g, gctx := errgroup.WithContext(wctx)
		g.Go(func() error { return out.follow(gctx) })
		g.Go(func() error { return unm.follow(gctx) })
		err := g.Wait()
		wcancel()
		if err != nil {
			return nil, err
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("audit: stopped while waiting for %d missing messages: %w", a.missing.Load(), err)
	}
	parked, err := a.readParked(ctx, js)
	if err != nil {
		return nil, err
	}
	if a.cfg.Progress != nil {
		a.progress(out.unreported+unm.unreported, true)
	}

	rep := &Report{
		Outgoing:   out.read,
		Unmapped:   unm.read,
		Parked:     parked,
		OutOfRange: out.outOfRange + unm.outOfRange,
		Devices:    out.devices(nil) + unm.devices(out),
		Mappings:   out.counts[KindMapping],

		MappingChecked:   out.mapping.checked,
		MappingUnchecked: out.mapping.unchecked,
		MappingOff:       out.mapping.off,
	}
	per := map[string][]Finding{}
	for _, src := range a.sources {
		rep.Ranges = append(rep.Ranges, src.Range)
		rep.Incoming += src.Count
		rep.Missing += src.missingCount()
		per[KindMissing] = append(per[KindMissing], a.missingFindings(ctx, js, src, cfg.MaxFindings-len(per[KindMissing]))...)
	}
	if cfg.StreamLayout != subjects.PartitionStreams {
		rep.IncomingFirst, rep.IncomingLast = a.sources[0].First, a.sources[0].Last
	}
	for _, r := range []*reader{out, unm} {
		rep.Reorders += r.counts[KindReorder]
		rep.Duplicates += r.counts[KindDuplicate]
		rep.StaleEpochs += r.counts[KindStaleEpoch]
		rep.Foreign += r.counts[KindForeign]
		for k, fs := range r.findings {
			per[k] = append(per[k], fs...)
		}
	}
	for _, k := range kinds {
		fs := per[k]
		rep.Findings = append(rep.Findings, fs[:min(len(fs), cfg.MaxFindings)]...)
	}
	rep.Elapsed = time.Since(start)
	return rep, nil
}

// auditor is the state shared by the two readers.
type auditor struct {
	cfg Config
	// sources are the streams holding INCOMING messages, in partition order; byName finds them
	// by the stream name a Nats-Msg-Id starts with.
	sources []*source
	byName  map[string]*source
	// ctlCreated is when the control bucket was created (Unix nanoseconds), 0 when unknown:
	// lease epochs start again with a new bucket.
	ctlCreated int64
	missing    atomic.Int64 // audited sequences not seen yet, of every source
	allFound   context.CancelFunc

	progressMu   sync.Mutex
	progressRead uint64
}

func snapshot(ctx context.Context, js jetstream.JetStream, cfg Config) (*auditor, error) {
	a := &auditor{cfg: cfg, byName: make(map[string]*source)}
	var missing uint64
	for _, name := range cfg.IncomingStreams(cfg.Layout.Partitions) {
		src, err := openSource(ctx, js, name, cfg.StreamLayout != subjects.PartitionStreams)
		if errors.Is(err, jetstream.ErrStreamNotFound) && markedDirect(ctx, js, cfg.Control) {
			return nil, directMode(cfg, fmt.Sprintf(" (key %s of the control bucket %s says so)", wire.ModeKey, cfg.Control))
		}
		if err != nil {
			return nil, err
		}
		a.sources = append(a.sources, src)
		a.byName[name] = src
		missing += src.Count
	}
	// A control bucket that cannot be read leaves ctlCreated 0: epochs are then compared as they are.
	if ci, err := streamInfo(ctx, js, subjects.BucketStream(cfg.Control), nil); err == nil {
		a.ctlCreated = ci.Created.UnixNano()
	}
	a.missing.Store(int64(missing))
	return a, nil
}

// progress adds n to the messages read and calls Config.Progress every 64k messages, or now.
func (a *auditor) progress(n uint64, now bool) {
	a.progressMu.Lock()
	defer a.progressMu.Unlock()
	before := a.progressRead
	a.progressRead += n
	if now || before>>16 != a.progressRead>>16 {
		a.cfg.Progress(a.progressRead)
	}
}

// markedDirect reports whether the control bucket says the deployment runs in direct mode. It is
// asked only once INCOMING is found missing, so that an audit in stream mode needs no permission
// to read the bucket's keys; a bucket that cannot be read within markTimeout says nothing.
func markedDirect(ctx context.Context, js jetstream.JetStream, control string) bool {
	ctx, cancel := context.WithTimeout(ctx, markTimeout)
	defer cancel()
	ctl, err := js.KeyValue(ctx, control)
	if err != nil {
		return false
	}
	e, err := ctl.Get(ctx, wire.ModeKey)
	return err == nil && wire.MarksDirect(e.Value())
}

// markTimeout bounds the read of the control bucket's mode key: a user not allowed to read it
// gets no answer at all.
const markTimeout = 5 * time.Second

// directMode is the refusal to audit a deployment in direct mode; where says how Run knows.
func directMode(cfg Config, where string) error {
	return fmt.Errorf("%w: the deployment runs in direct mode%s. Devices publish straight to the replicas, whose "+
		"republish to %s (or %s) is what acknowledges them: nothing records what they sent before that, so there "+
		"is nothing to audit %s against. Check instead: each publisher's PubAcks (a message is stored once it is "+
		"acknowledged, and one that got no PubAck must be resent with the same Nats-Msg-Id until it does), %s's "+
		"deduplication of those resends (its duplicate window must outlast the publishers' retries: `nats stream "+
		"info %s`), the KVMapper-Reason of what %s holds, and `kvmapper status`",
		ErrDirectMode, where, cfg.Outgoing, cfg.Unmapped, cfg.Outgoing, cfg.Outgoing, cfg.Outgoing, cfg.Unmapped)
}
