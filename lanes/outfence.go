package lanes

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"

	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// OutputFence is a lane's fence in one output stream: the partition's fence subject there and
// the stream sequence of the lane's own fence record on it. Every write of the lane to Stream
// after its takeover is to check, with Nats-Expected-Last-Subject-Sequence: Seq and
// Nats-Expected-Last-Subject-Sequence-Subject: Subject, that no later owner has written its
// record since (docs/design-fencing.md, "Every write").
type OutputFence struct {
	Stream, Subject string
	Seq             uint64
}

// fenceOutputs writes the lane's fence record on the partition's fence subject in each stream
// it fences — those of Config.Fences (as last read: Config.RefreshFences) and of the
// Assignment's Fence — before the lane writes anything, and keeps the sequence of each in
// l.fences. After it, a stream refuses every checked write of an earlier owner. It returns
// [ErrFenced] when a stream already holds the record of a later owner than this lane's (it has
// been taken over since it claimed), [ErrFenceWrite] when a record cannot be written, and
// retries anything else with backoff until ctx ends. It then says what the lane vouches for
// (l.checked, see [Pool.Checked]).
func (l *lane) fenceOutputs(ctx context.Context) error {
	if l.p.cfg.Unfenced {
		return nil
	}
	streams := l.p.fenceSet(ctx)
	for _, s := range l.a.Fence {
		if !slices.Contains(streams, s) {
			streams = append(streams, s)
		}
	}
	if len(streams) == 0 {
		return nil
	}
	control, err := l.p.controlIncarnation(ctx)
	if err != nil {
		return err
	}
	rec := wire.FenceRecord{Partition: l.a.Partition, Epoch: l.a.Epoch, Owner: l.a.Owner, Control: control, Nonce: rand.Text()}
	fences := make([]OutputFence, len(streams))
	g, gctx := errgroup.WithContext(ctx)
	for i, stream := range streams {
		g.Go(func() error {
			f, err := l.writeFence(gctx, stream, rec)
			fences[i] = f
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	l.fenceOrder = fences
	l.fences = make(map[string]OutputFence, len(fences))
	for _, f := range fences {
		l.fences[f.Stream] = f
	}
	// Every stream the lane writes fenced, and its writers check every write (newWriter
	// never writes a fenced stream in fast-ingest batches): its writes after a successor's
	// records are refused, and the others may judge it dead early.
	written := l.p.written()
	for _, s := range written {
		if _, ok := l.fences[s]; !ok {
			return nil
		}
	}
	l.checked = wire.FormatChecked(written)
	return nil
}

// fenceAttemptTimeout bounds one read or write of a fence record.
const fenceAttemptTimeout = 2 * time.Second

// writeFence writes rec on its partition's fence subject in stream over whatever record is last
// there, unless that one is a later owner's. It reads the last record from the stream's leader,
// writes with compare-and-set on its sequence, and starts again when another write got there
// first (10071, a record or a checked batch in between; 10164, one being applied); a write whose
// answer is lost is read back and recognised by rec's nonce.
//
// The record rolls up its subject (Nats-Rollup: sub, where the stream allows it, as setup makes
// it): the check needs only the last record, and one record per takeover grew without bound.
// A stream full of data (discard new: PARKED at its MaxMsgs) refuses even a rollup, which the
// server stores before it purges: then the partition's old record is purged, which makes room
// and fences the old owner just as well (its checks name it), and the record written over
// nothing. A record that cannot be written — refused for good, or unanswered for FenceTimeout —
// is returned as [ErrFenceWrite]: the lane may not write the stream, and its owner gives the
// partition up rather than hold it.
func (l *lane) writeFence(ctx context.Context, stream string, rec wire.FenceRecord) (OutputFence, error) {
	backoff := l.p.cfg.RetryBackoff
	deadline := time.Now().Add(l.p.cfg.FenceTimeout)
	purged := "" // the subject whose old record was purged to make room
	for {
		f, err := l.tryFenceOutput(ctx, stream, rec, &purged)
		if err == nil {
			l.log.Debug().Str("stream", stream).Str("subject", f.Subject).Uint64("fence", f.Seq).Msg("output fenced")
			return f, nil
		}
		if errors.Is(err, ErrFenced) || errors.Is(err, ErrFenceWrite) || ctx.Err() != nil {
			return OutputFence{}, err
		}
		if time.Now().After(deadline) {
			return OutputFence{}, fmt.Errorf("%w: %s, partition %d: no record stored in %v: %w (the stream must capture %s and have a leader: kvmapper setup, nats stream info %s)",
				ErrFenceWrite, stream, rec.Partition, l.p.cfg.FenceTimeout, err, subjects.FenceFilter(stream), stream)
		}
		if !kvcas.IsConflict(err) && !kvcas.InProcess(err) {
			l.p.warn("output-fence", func(e *zerolog.Event) {
				e.Int("partition", rec.Partition).Str("stream", stream).Err(err).
					Msg("writing the partition's fence record failed; retrying (the stream must capture " + subjects.FenceFilter(stream) + ": kvmapper setup)")
			})
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return OutputFence{}, fmt.Errorf("lanes: fencing %s for partition %d: %w", stream, rec.Partition, err)
		}
		backoff = min(2*backoff, l.p.cfg.MaxRetryBackoff)
	}
}

// tryFenceOutput makes one attempt of writeFence and returns rec's fence in stream: the fence
// subject of the stream's incarnation as read now, and the sequence of rec on it. purged names
// the subject an earlier attempt purged the partition's old record on, to make room.
func (l *lane) tryFenceOutput(ctx context.Context, stream string, rec wire.FenceRecord, purged *string) (OutputFence, error) {
	rctx, cancel := context.WithTimeout(ctx, fenceAttemptTimeout)
	defer cancel()
	s, err := l.p.js.Stream(rctx, stream)
	if err != nil {
		return OutputFence{}, fmt.Errorf("lanes: reading stream %s: %w", stream, err)
	}
	sc := s.CachedInfo().Config
	subject := subjects.FenceSubject(stream, rec.Partition, wire.Incarnation(s.CachedInfo().Created))
	seq, err := l.fenceOn(rctx, s, sc, subject, rec, purged)
	return OutputFence{Stream: stream, Subject: subject, Seq: seq}, err
}

// fenceOn writes rec on subject in stream s, configured as sc, for tryFenceOutput.
func (l *lane) fenceOn(rctx context.Context, s jetstream.Stream, sc jetstream.StreamConfig, subject string, rec wire.FenceRecord, purged *string) (uint64, error) {
	stream := sc.Name
	if !captures(sc.Subjects, subject) {
		return 0, fmt.Errorf("%w: %s, partition %d: the stream does not capture %s (it captures %v): run kvmapper setup, which adds %s",
			ErrFenceWrite, stream, rec.Partition, subject, sc.Subjects, subjects.FenceFilter(stream))
	}
	var last uint64
	m, err := kvcas.LastOfSubject(rctx, l.p.js, stream, subject)
	switch {
	case errors.Is(err, kvcas.ErrNotFound):
	case err != nil:
		return 0, err
	default:
		old, perr := wire.ParseFenceRecord(m.Data)
		switch {
		case perr == nil && old.Nonce == rec.Nonce:
			return m.Sequence, nil // an earlier attempt of ours, whose answer was lost
		case perr == nil && old.Supersedes(rec):
			return 0, fmt.Errorf("%w: %s holds the fence record of %s, epoch %d, later than this lane's epoch %d",
				ErrFenced, subject, old.Owner, old.Epoch, rec.Epoch)
		}
		last = m.Sequence
	}
	msg := nats.NewMsg(subject)
	msg.Data = rec.Append(nil)
	if sc.AllowRollup && !sc.DenyPurge {
		msg.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupSubject)
	}
	ack, err := l.p.js.PublishMsg(rctx, msg, jetstream.WithExpectLastSequencePerSubject(last))
	if err == nil {
		return ack.Sequence, nil
	}
	if kvcas.IsConflict(err) || kvcas.InProcess(err) {
		return 0, err
	}
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		// No answer: it may have been stored. The next attempt reads it back.
		return 0, fmt.Errorf("lanes: writing the fence record on %s: %w", subject, err)
	}
	if full(apiErr) {
		if last == 0 || *purged == subject || sc.DenyPurge {
			return 0, fmt.Errorf("%w: %s is full (%s) and holds no record of partition %d to make room with: make room in it (`nats stream edit %s` with higher --max-msgs or --max-bytes, or release what it holds); partition %d maps once a record fits",
				ErrFenceWrite, stream, apiErr.Description, rec.Partition, stream, rec.Partition)
		}
		// Purging the old record fences its owner as writing over it would: every write of
		// that owner checks that the record is still the subject's last. A record written
		// since (a later owner's) is above last and stays.
		if err := s.Purge(rctx, jetstream.WithPurgeSubject(subject), jetstream.WithPurgeSequence(last+1)); err != nil {
			return 0, fmt.Errorf("lanes: purging the old fence record on %s of full stream %s: %w", subject, stream, err)
		}
		*purged = subject
		return 0, fmt.Errorf("lanes: %s is full: purged partition %d's old fence record to write the new one: %w", stream, rec.Partition, err)
	}
	if apiErr.Code == 503 || apiErr.Code == 429 || apiErr.Code == 408 {
		return 0, fmt.Errorf("lanes: writing the fence record on %s: %w", subject, err)
	}
	return 0, fmt.Errorf("%w: %s refused the fence record of partition %d: %w (check the stream's configuration: kvmapper setup)",
		ErrFenceWrite, stream, rec.Partition, err)
}

// full reports whether a stream refused a write for its limits as a whole (discard new): its
// maximum messages or bytes.
func full(apiErr *jetstream.APIError) bool {
	return apiErr.ErrorCode == errCodeStoreFailed &&
		(strings.Contains(apiErr.Description, storeMaxMsgs) || strings.Contains(apiErr.Description, storeMaxBytes))
}

// captures reports whether a stream capturing filters stores messages on subject.
func captures(filters []string, subject string) bool {
	for _, f := range filters {
		if matches(f, subject) {
			return true
		}
	}
	return false
}

// matches reports whether the subject filter f (with * and > wildcards) matches subject.
func matches(f, subject string) bool {
	for {
		ft, frest, fmore := strings.Cut(f, ".")
		st, srest, smore := strings.Cut(subject, ".")
		switch {
		case ft == ">":
			return true
		case ft != "*" && ft != st:
			return false
		case !fmore || !smore:
			return fmore == smore
		}
		f, subject = frest, srest
	}
}

// controlIncarnation returns the incarnation of the control bucket, read at each claim: a bucket
// deleted and made again under a running pool starts its revisions (the epochs) from 1, and a
// record under the incarnation read before would lose to every record of the old bucket's larger
// epochs (TestFenceRecordAfterTheControlBucketIsRecreated). When the bucket cannot be read, the
// last incarnation read serves: a record under a stale one is refused (ErrFenced) and the
// partition is claimed again later, which reads again.
func (p *Pool) controlIncarnation(ctx context.Context) (string, error) {
	inc, err := p.readControlIncarnation(ctx) // not under the lock: lanes claimed together read at once
	p.incMu.Lock()
	defer p.incMu.Unlock()
	switch {
	case err == nil:
		p.control = inc
	case p.control == "":
		return "", err
	}
	return p.control, nil
}

func (p *Pool) readControlIncarnation(ctx context.Context) (string, error) {
	rctx, cancel := context.WithTimeout(ctx, fenceAttemptTimeout)
	defer cancel()
	st, err := p.ctl.Status(rctx)
	if err != nil {
		return "", fmt.Errorf("lanes: reading bucket %s: %w", p.ctl.Bucket(), err)
	}
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok {
		return "", fmt.Errorf("lanes: bucket %s: no stream info in its status", p.ctl.Bucket())
	}
	return wire.Incarnation(bs.StreamInfo().Created), nil
}

// Fences returns the fences of the running lane of partition p in its output streams, nil when
// it runs none or no stream is fenced. It is for the writer and for tests; safe for concurrent
// use once the lane has started publishing.
func (p *Pool) Fences(partition int) []OutputFence {
	p.lanesMu.Lock()
	defer p.lanesMu.Unlock()
	for l := range p.lanes {
		if l.a.Partition == partition {
			return slices.Clone(l.fenceOrder)
		}
	}
	return nil
}

// Checked returns what the running lane of partition under epoch vouches for, to be advertised
// on the partition's lease (election.Config.Checked): [wire.FormatChecked] of the streams it
// writes when it wrote its fence record in each and checks it on every write, so that whatever
// it writes after a successor's records is refused; "" otherwise (a stream unfenced, the lane
// not running yet, [Config.Unfenced]). It is fixed for the lane's life: its writers never write
// a fenced stream unchecked. Safe for concurrent use, and cheap.
func (p *Pool) Checked(partition int, epoch uint64) string {
	p.lanesMu.Lock()
	defer p.lanesMu.Unlock()
	for l := range p.lanes {
		if l.a.Partition == partition && l.a.Epoch == epoch {
			return l.checked
		}
	}
	return ""
}

// CanJudge reports whether a silent owner whose lease vouched for checked ([Pool.Checked], on
// that owner's replica) may be taken over by this pool before its lease expires
// (election.Config.Judge): checked is this protocol's, and names every output stream this pool
// writes and every stream it fences. A lane taking the partition over then fences every stream
// checked names (Assignment.Fence), whose records refuse what that owner still writes. A pool
// that writes no fence records ([Config.Unfenced]) judges nobody. Safe for concurrent use.
func (p *Pool) CanJudge(checked string) bool {
	if p.cfg.Unfenced {
		return false
	}
	streams, ok := wire.ParseChecked(checked)
	if !ok {
		return false
	}
	var fences []string
	if f := p.modes.fences.Load(); f != nil {
		fences = *f
	}
	for _, s := range append(p.written(), fences...) {
		if !slices.Contains(streams, s) {
			return false
		}
	}
	return true
}

// CanFence reports whether the pool's lanes fence every output stream they write, as far as
// ctx lets it read the fence record and the streams now: whether its owners will advertise
// checked writes ([Pool.Checked]) and so may be judged dead early.
func (p *Pool) CanFence(ctx context.Context) bool {
	if p.cfg.Unfenced {
		return false
	}
	fences := p.fenceSet(ctx)
	for _, s := range p.written() {
		if !slices.Contains(fences, s) {
			return false
		}
	}
	return true
}

// Unfenced reports whether the pool runs the [Config.Unfenced] drill.
func (p *Pool) Unfenced() bool { return p.cfg.Unfenced }

// written returns the output streams the pool's lanes write: OUTGOING, UNMAPPED and, where it
// parks or drains, PARKED.
func (p *Pool) written() []string {
	out := []string{p.cfg.Outgoing, p.cfg.Unmapped}
	if p.cfg.Park.Stream != "" {
		out = append(out, p.cfg.Park.Stream)
	}
	return out
}
