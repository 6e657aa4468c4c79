package audit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// pullBatch is how many messages each ordered consumer asks for at a time. Headers-only messages
// are small; a larger batch keeps the server busy while the reader works.
const pullBatch = 4096

// progressEvery is how many messages a reader reads between reports to Config.Progress.
const progressEvery = 4096

// reader reads one output stream in order and checks what only that stream can tell: per-device
// order and per-partition epochs. Its state belongs to the goroutine that calls catchUp and follow.
type reader struct {
	a         *auditor
	name      string
	js        jetstream.JetStream
	cons      jetstream.Consumer
	it        jetstream.MessagesContext
	stopAfter func() bool
	startLast uint64 // LastSeq when opened
	startMsgs uint64 // Msgs when opened
	seen      bool   // catchUp has read a message
	lastSeq   uint64 // the stream sequence of the last message catchUp read
	subj      devParser
	malformed string        // the subject whose device token means nothing, or ""
	mapping   *mappingCheck // OUTGOING's: each message against the value it was mapped with

	read, outOfRange uint64
	unreported       uint64 // read but not yet passed to progress
	dev              map[string]int32
	last             []uint64 // by dev index: the highest INCOMING sequence seen
	epochs           []uint64 // by partition: the highest epoch seen; 0 for none
	epochAt          []int64  // by partition: when the message with that epoch was stored
	firstAt          []int64  // by partition: when its first message with an epoch was stored
	restarted        []bool   // by partition: its epochs started again after the control bucket's creation
	counts           map[string]uint64
	findings         map[string][]Finding
}

// open snapshots stream name and starts reading it from its first message. The reader reads
// headers only; ctx ending stops it.
func (a *auditor) open(ctx context.Context, js jetstream.JetStream, name string, t *subjects.Template, malformed string) (*reader, error) {
	info, err := streamInfo(ctx, js, name, nil)
	if err != nil {
		return nil, fmt.Errorf("audit: opening stream %s: %w", name, err)
	}
	st := info.State
	cons, err := orderedConsumer(ctx, js, name, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverAllPolicy,
		HeadersOnly:   true,
		// The server removes the consumer this long after a reader that could not delete it
		// (stop) went away.
		InactiveThreshold: 30 * time.Second,
	}, nil)
	if err != nil {
		return nil, fmt.Errorf("audit: creating a consumer on stream %s: %w", name, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(pullBatch))
	if err != nil {
		if ci := cons.CachedInfo(); ci != nil {
			dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = js.DeleteConsumer(dctx, name, ci.Name) // best effort: InactiveThreshold is the fallback
			cancel()
		}
		return nil, fmt.Errorf("audit: reading stream %s: %w", name, err)
	}
	return &reader{
		a:         a,
		name:      name,
		js:        js,
		cons:      cons,
		it:        it,
		stopAfter: context.AfterFunc(ctx, it.Stop),
		startLast: st.LastSeq,
		startMsgs: st.Msgs,
		subj:      newDevParser(t),
		malformed: malformed,
		dev:       make(map[string]int32),
		epochs:    make([]uint64, a.cfg.Layout.Partitions),
		epochAt:   make([]int64, a.cfg.Layout.Partitions),
		firstAt:   make([]int64, a.cfg.Layout.Partitions),
		restarted: make([]bool, a.cfg.Layout.Partitions),
		counts:    make(map[string]uint64),
		findings:  make(map[string][]Finding),
	}, nil
}

// unavailableRetry is how long the audit keeps asking while the servers answer 503 (JetStream
// temporarily unavailable, err_code 10008) or do not answer within unavailableAttempt: a cluster
// electing its meta leader or a stream's leader, or a server whose partition from the others has
// just healed (seen in CI: the audit after a healed partition got the 503, and, under -race, a
// request after the heal that was never answered). The audit would otherwise fail, or take a
// stream it could not read for one that holds nothing, where waiting a few seconds succeeds.
const (
	unavailableRetry   = 30 * time.Second
	unavailableAttempt = 5 * time.Second
)

// whileUnavailable calls f, asking again every 250ms while the answer is a 503 or none comes
// within unavailableAttempt, for unavailableRetry at most. retried, when set, is told of each
// failure retried.
func whileUnavailable[T any](ctx context.Context, retried func(error), f func(context.Context) (T, error)) (T, error) {
	deadline := time.Now().Add(unavailableRetry)
	for {
		actx, cancel := context.WithTimeout(ctx, unavailableAttempt)
		v, err := f(actx)
		cancel()
		var apiErr *jetstream.APIError
		unavailable := errors.As(err, &apiErr) && apiErr.Code == 503
		if err == nil || !(unavailable || unanswered(ctx, err)) || time.Now().After(deadline) {
			return v, err
		}
		if retried != nil {
			retried(err)
		}
		select {
		case <-ctx.Done():
			return v, err
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// streamIfAllowed returns stream name, waiting out 503s ([whileUnavailable]), but a request
// not answered at all is taken at once for one the user may not make (the server drops it,
// telling only the connection's error handler): errNotAnswered. For the streams the audit reads
// only when it may (PARKED, the groups bucket).
func streamIfAllowed(ctx context.Context, js jetstream.JetStream, name string, retried func(error)) (jetstream.Stream, error) {
	return whileUnavailable(ctx, retried, func(actx context.Context) (jetstream.Stream, error) {
		s, err := js.Stream(actx, name)
		if unanswered(ctx, err) {
			return nil, errNotAnswered
		}
		return s, err
	})
}

// errNotAnswered is a request nobody answered in time, taken as not allowed.
var errNotAnswered = errors.New("no answer in time (not allowed?)")

// unanswered reports whether err is a request's answer not coming in time while ctx still runs.
func unanswered(ctx context.Context, err error) bool {
	return ctx.Err() == nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout))
}

// orderedConsumer creates an ordered consumer on stream name, while the servers answer 503 too
// ([whileUnavailable]).
func orderedConsumer(ctx context.Context, js jetstream.JetStream, name string, cfg jetstream.OrderedConsumerConfig, retried func(error)) (jetstream.Consumer, error) {
	return whileUnavailable(ctx, retried, func(ctx context.Context) (jetstream.Consumer, error) {
		return js.OrderedConsumer(ctx, name, cfg)
	})
}

// streamInfo reads the state of stream name, while the servers answer 503 too
// ([whileUnavailable]). A stream that does not exist is jetstream.ErrStreamNotFound at once.
func streamInfo(ctx context.Context, js jetstream.JetStream, name string, retried func(error), opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error) {
	return whileUnavailable(ctx, retried, func(ctx context.Context) (*jetstream.StreamInfo, error) {
		s, err := js.Stream(ctx, name)
		if err != nil {
			return nil, err
		}
		if len(opts) == 0 {
			return s.CachedInfo(), nil
		}
		return s.Info(ctx, opts...)
	})
}

// stop ends the reading and deletes the consumer: a stopped iterator's last pull request would
// otherwise keep the server delivering to nobody, slowing the next audit. The iterator's
// goroutines exit on their own once it has unsubscribed.
func (r *reader) stop() {
	r.stopAfter()
	r.it.Stop()
	if ci := r.cons.CachedInfo(); ci != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.js.DeleteConsumer(ctx, r.name, ci.Name) // best effort: InactiveThreshold is the fallback
	}
}

// catchUp reads up to the stream's last sequence when it was opened, or to its current end if
// that comes first (the last messages were deleted meanwhile).
func (r *reader) catchUp(ctx context.Context) error {
	if r.startMsgs == 0 {
		return nil
	}
	for {
		m, err := r.it.Next(jetstream.NextMaxWait(idleCheck))
		if errors.Is(err, nats.ErrTimeout) {
			// Nothing came for a while: if what is left of the stream was removed meanwhile
			// (limits, a purge), there is nothing more to wait for.
			if done, err := r.drained(ctx); done || err != nil {
				return err
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				// Say how far it got: a read that stalls (a server that cannot deliver, after a
				// network fault) is then told from one that was merely slow.
				return fmt.Errorf("audit: reading stream %s: %d messages read, up to sequence %d of %d: %w",
					r.name, r.read, r.lastSeq, r.startLast, ctx.Err())
			}
			return fmt.Errorf("audit: reading stream %s: %w", r.name, err)
		}
		r.seen = true
		sseq, pending, err := r.handle(ctx, m)
		if err != nil {
			return err
		}
		r.lastSeq = sseq
		if sseq >= r.startLast || pending == 0 {
			return nil
		}
	}
}

// fencePrefix starts the subjects of the fence records output streams hold beside the messages.
const fencePrefix = subjects.FencePrefix + "."

// idleCheck is how long catchUp waits for a message before it asks whether any are left.
const idleCheck = 2 * time.Second

// drained reports whether the stream holds nothing past what the reader has read.
func (r *reader) drained(ctx context.Context) (bool, error) {
	info, err := streamInfo(ctx, r.js, r.name, nil) // js.Stream asks the server each time
	if err != nil {
		return false, fmt.Errorf("audit: reading stream %s: %w", r.name, err)
	}
	st := info.State
	return st.Msgs == 0 || (r.seen && st.LastSeq <= r.lastSeq), nil
}

// follow reads whatever arrives until wctx ends; the iterator is stopped then.
func (r *reader) follow(wctx context.Context) error {
	defer context.AfterFunc(wctx, r.it.Stop)()
	for {
		m, err := r.it.Next()
		if err != nil {
			if wctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("audit: reading stream %s: %w", r.name, err)
		}
		if _, _, err := r.handle(wctx, m); err != nil {
			if wctx.Err() != nil {
				return nil
			}
			return err
		}
	}
}

// handle checks one message and returns its stream sequence and the messages pending after it.
// It does not allocate unless it records a finding or a new device, or reads a revision of the
// groups bucket it has not read yet (OUTGOING's mapping check); its error is one reading it.
func (r *reader) handle(ctx context.Context, m jetstream.Msg) (sseq, pending uint64, err error) {
	ack, ok := subjects.ParseAck(m.Reply())
	if !ok {
		if md, err := m.Metadata(); err == nil {
			ack = subjects.Ack{StreamSeq: md.Sequence.Stream, Pending: md.NumPending, Time: md.Timestamp.UnixNano()}
		}
	}
	sseq, pending = ack.StreamSeq, ack.Pending
	if strings.HasPrefix(m.Subject(), fencePrefix) {
		// A partition owner's fence record (docs/design-fencing.md): no message of a device.
		return sseq, pending, nil
	}
	r.read++
	if r.a.cfg.Progress != nil {
		if r.unreported++; r.unreported == progressEvery {
			r.a.progress(r.unreported, false)
			r.unreported = 0
		}
	}
	hdr := m.Headers()
	subject := m.Subject()
	var device string
	if subject != r.malformed {
		device = r.subj.device(subject)
	}
	id := hdr.Get(nats.MsgIdHdr)
	src, seq, ok := r.a.sourceOf(id, ack.Time)
	if !ok {
		if r.note(KindForeign) {
			detail := "no Nats-Msg-Id header"
			if id != "" {
				detail = fmt.Sprintf("Nats-Msg-Id %q does not have the form %s<sequence>", id, r.a.sources[0].idPrefix)
				if len(r.a.sources) > 1 {
					detail = fmt.Sprintf("Nats-Msg-Id %q names no partition stream's current incarnation (%s<sequence> …)", id, r.a.sources[0].idPrefix)
				}
			}
			r.add(Finding{Kind: KindForeign, Device: device, StreamSeq: sseq, Detail: detail + " (subject " + subject + ")"})
		}
		return sseq, pending, nil
	}
	inRange, dup := r.a.mark(src, seq)
	if !inRange {
		r.outOfRange++
	}
	if device != "" {
		i, known := r.dev[device]
		switch {
		case !known:
			r.dev[strings.Clone(device)] = int32(len(r.last))
			r.last = append(r.last, seq)
		case seq > r.last[i]:
			r.last[i] = seq
		case dup:
			// Reported as a duplicate below; a replayed copy is not also a reorder.
		case seq == r.last[i]:
			dup = true // outside the audited range, but the same sequence twice in a row
		default:
			if r.note(KindReorder) {
				r.add(Finding{Kind: KindReorder, Device: device, Seq: seq, StreamSeq: sseq,
					Detail: fmt.Sprintf("%s:%d stored after %s:%d of the same device", src.Stream, seq, src.Stream, r.last[i])})
			}
		}
	}
	if dup {
		if r.note(KindDuplicate) {
			r.add(Finding{Kind: KindDuplicate, Device: device, Seq: seq, StreamSeq: sseq,
				Detail: fmt.Sprintf("%s:%d stored again (subject %s)", src.Stream, seq, subject)})
		}
	}
	if pv, ok := wire.ReadProvenance(hdr.Get); ok && pv.HasPartition && pv.Epoch != 0 {
		p, e := uint64(pv.Partition), pv.Epoch
		if p < uint64(len(r.epochs)) {
			if prev := r.epochs[p]; e < prev && !r.epochsRestarted(int(p), ack.Time) {
				if r.note(KindStaleEpoch) {
					r.add(Finding{Kind: KindStaleEpoch, Device: device, Seq: seq, StreamSeq: sseq,
						Detail: fmt.Sprintf("partition %d epoch %d stored after epoch %d: a deposed owner's write", p, e, prev)})
				}
			} else {
				r.epochs[p], r.epochAt[p] = e, ack.Time
				if r.firstAt[p] == 0 {
					r.firstAt[p] = ack.Time
				}
			}
		}
	}
	if r.mapping != nil {
		detail, err := r.mapping.check(ctx, subject, hdr, device)
		if err != nil {
			return sseq, pending, err
		}
		if detail != "" && r.note(KindMapping) {
			r.add(Finding{Kind: KindMapping, Device: device, Seq: seq, StreamSeq: sseq, Detail: detail})
		}
	}
	return sseq, pending, nil
}

// note counts a finding of kind and reports whether to keep it as an example (then the caller
// builds it and calls add): past MaxFindings nothing is formatted.
func (r *reader) note(kind string) bool {
	r.counts[kind]++
	return len(r.findings[kind]) < r.a.cfg.MaxFindings
}

func (r *reader) add(f Finding) {
	f.Stream = r.name
	r.findings[f.Kind] = append(r.findings[f.Kind], f)
}

// devices returns the number of devices r saw that other (if not nil) did not.
func (r *reader) devices(other *reader) int {
	if other == nil {
		return len(r.dev)
	}
	n := 0
	for d := range r.dev {
		if _, ok := other.dev[d]; !ok {
			n++
		}
	}
	return n
}

// epochsRestarted tells whether a message of partition p stored at now may carry a lower epoch
// than the highest seen because the control bucket was created in between: lease revisions, and
// so epochs, start again in a new bucket. That is the first drop stored after the creation in a
// partition written before it, whether the higher epoch was stored before the creation or after
// it: an owner goes on writing under its old bucket's lease until it notices the bucket is new
// and claims again, lower (seen in CI: epoch 24 stored on both sides of the creation, then the
// re-claim's 23). A later drop is a deposed owner's write. Only the current bucket's creation
// is known: epochs that started again more than once within one output are told apart at the
// last restart only.
func (r *reader) epochsRestarted(p int, now int64) bool {
	c := r.a.ctlCreated
	if c == 0 || now < c || r.firstAt[p] >= c || r.restarted[p] {
		return false
	}
	r.restarted[p] = true
	return true
}
