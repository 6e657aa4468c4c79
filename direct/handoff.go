package direct

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// Headers of the handoff protocol (see [Pool]): an announcement carries the new owner's epoch and
// id, an answer the epoch it answers, the old owner's table revision, how many reply subjects the
// whole answer lists, and whether this part is the last one.
const (
	hdrEpoch    = "KVMapper-Handoff-Epoch"
	hdrReplica  = "KVMapper-Handoff-Replica"
	hdrRevision = "KVMapper-Handoff-Revision"
	hdrCount    = "KVMapper-Handoff-Count"
	hdrLast     = "KVMapper-Handoff-Last"
	hdrFenced   = "KVMapper-Handoff-Fenced"
)

// answer is what a new owner learns from the previous one.
type answer struct {
	replies  map[string]struct{}
	revision uint64
	count    int  // what the answer said it lists
	fenced   bool // the previous owner was deposed, not released: it recorded nothing
	last     bool
}

// add takes one part of an answer in.
func (a *answer) add(m *nats.Msg) error {
	rev, err1 := strconv.ParseUint(m.Header.Get(hdrRevision), 10, 64)
	count, err2 := strconv.Atoi(m.Header.Get(hdrCount))
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	a.revision, a.count = rev, count
	a.fenced = a.fenced || m.Header.Get(hdrFenced) != ""
	a.last = m.Header.Get(hdrLast) != ""
	for line := range bytes.SplitSeq(m.Data, []byte{'\n'}) {
		if len(line) > 0 {
			a.replies[string(line)] = struct{}{}
		}
	}
	return nil
}

// join subscribes to the partition, then takes it over from its previous owner if one answers
// the announcement, and subscribes to the announcements of the next owners.
func (l *lane) join(ctx context.Context) error {
	if err := l.subscribe(); err != nil {
		return err
	}
	start := time.Now()
	ans, err := l.announce(ctx)
	if err != nil {
		return err
	}
	// The previous owner mapped with its table up to ans.revision; mapping with an older one
	// could send a device back to a group it has left (I4). With no answer (a takeover from a
	// dead owner, or the first owner) its revision is unknown: the table catches up with the
	// bucket. Either way the lane has subscribed and announced itself first, so that the
	// previous owner hands over instead of timing out, and what arrives meanwhile waits here.
	if rev := l.p.cfg.Revision; rev != nil && (ans == nil || rev() < ans.revision) {
		if err := l.p.cfg.CatchUp(ctx); err != nil {
			return err
		}
	}
	if ans != nil {
		if len(ans.replies) > 0 {
			l.skip, l.skipUntil = ans.replies, time.Now().Add(l.p.cfg.HandoffTimeout)
		}
		l.log.Debug().Int("forwarded_by_previous", len(ans.replies)).Int("held", l.q.len()).
			Bool("previous_fenced", ans.fenced).Int64("waited_ms", time.Since(start).Round(time.Millisecond).Milliseconds()).Msg("partition taken over")
	}
	sub, err := l.p.nc.Subscribe(l.p.handoffSubject(l.a.Partition), func(m *nats.Msg) {
		select {
		case l.announces <- m:
		default:
		}
	})
	if err != nil {
		return errors.Join(errors.New("direct: subscribing to "+l.p.handoffSubject(l.a.Partition)), err)
	}
	l.handoff = sub
	// The next owner announces itself from another connection, as soon as this lane's lease is
	// gone, which can be right after the join (a lane released while it joins): unflushed, the
	// subscription may reach the server after that announcement, which then finds no responders,
	// and the next owner serves beside this lane, which lingers forwarding until HandoffTimeout
	// (TestReleasedWhileJoiningHandsOver, 1 run in 50 with both cores busy: messages stored twice).
	if err := l.p.nc.FlushTimeout(l.p.cfg.AnswerTimeout); err != nil {
		// Reconnecting: the subscription is made again on the new connection.
		l.log.Debug().Err(err).Msg("flushing the subscription to handoff announcements failed")
	}
	return nil
}

// reannounces is how many times an announcement is sent within AnswerTimeout while no part of
// an answer has come. A previous owner killed after the announcement reached it (a kill -9 in
// the middle of a handoff) never answers; its subscription went with its connection, so the
// next announcement gets no responders at once, instead of the partition's messages waiting
// for the whole AnswerTimeout. A live previous owner keeps its subscription until it has
// answered, and answers once: the repeats change nothing for it.
const reannounces = 10

// announce tells a previous owner still forwarding the partition that this lane has subscribed,
// and returns its answer: nil when nobody forwards it (no responders, at the first announcement
// or at a repeat), or nobody answered in time.
func (l *lane) announce(ctx context.Context) (*answer, error) {
	nc := l.p.nc
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, errors.Join(errors.New("direct: subscribing to a handoff inbox"), err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	m := nats.NewMsg(l.p.handoffSubject(l.a.Partition))
	m.Reply = inbox
	m.Header.Set(hdrEpoch, strconv.FormatUint(l.a.Epoch, 10))
	m.Header.Set(hdrReplica, l.p.cfg.Replica)
	if err := nc.PublishMsg(m); err != nil {
		return nil, errors.Join(errors.New("direct: announcing on "+m.Subject), err)
	}
	ans := &answer{replies: map[string]struct{}{}}
	parts := 0
	first := time.Now().Add(l.p.cfg.AnswerTimeout) // when the wait for a first part ends
	for {
		wait := l.p.cfg.AnswerTimeout
		if parts == 0 {
			wait = min(l.p.cfg.AnswerTimeout/reannounces, time.Until(first))
		}
		wctx, cancel := context.WithTimeout(ctx, wait)
		r, err := sub.NextMsgWithContext(wctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case errors.Is(err, nats.ErrNoResponders) && parts == 0:
			return nil, nil // nobody forwards the partition, or its previous owner died
		case errors.Is(err, context.DeadlineExceeded) && parts == 0 && time.Now().Before(first):
			if err := nc.PublishMsg(m); err != nil {
				return nil, errors.Join(errors.New("direct: announcing on "+m.Subject), err)
			}
			continue
		case err != nil:
			l.p.warn("handoff answer", func(e *zerolog.Event) {
				e.Int("partition", l.a.Partition).Int("parts", parts).Err(err).
					Msg("the previous owner did not answer in time: serving what arrives from now on; what both forward is stored twice unless it carries a Nats-Msg-Id")
			})
			if parts == 0 {
				return nil, nil
			}
			return ans, nil
		case r.Header.Get(hdrEpoch) != m.Header.Get(hdrEpoch):
			continue
		}
		if err := ans.add(r); err != nil {
			l.log.Warn().Err(err).Msg("unreadable handoff answer: serving without it")
			return nil, nil
		}
		parts++
		if ans.last {
			if len(ans.replies) != ans.count {
				l.log.Warn().Int("listed", ans.count).Int("received", len(ans.replies)).
					Msg("handoff answer incomplete: what both forward is stored twice unless it carries a Nats-Msg-Id")
			}
			return ans, nil
		}
	}
}

// newer reports whether m announces an owner with a later epoch than this lane's.
func (l *lane) newer(m *nats.Msg) bool {
	e, err := strconv.ParseUint(m.Header.Get(hdrEpoch), 10, 64)
	return err == nil && e > l.a.Epoch && m.Reply != ""
}

// linger goes on forwarding a released partition, recording what it forwards, until its next
// owner announces itself (then cutover) or HandoffTimeout passes.
func (l *lane) linger() {
	if alone := l.p.cfg.Alone; alone != nil {
		ctx, cancel := context.WithTimeout(context.Background(), l.p.cfg.AnswerTimeout)
		ok := alone(ctx)
		cancel()
		if ok {
			l.log.Debug().Msg("no other replica: partition stops without a handoff")
			return
		}
	}
	l.recording = true
	for _, r := range l.recent[l.recentHead:] {
		l.recorded = append(l.recorded, r.reply)
	}
	l.recent = nil
	deadline := time.NewTimer(l.p.cfg.HandoffTimeout)
	defer deadline.Stop()
	for {
		select {
		case <-deadline.C:
			l.p.warn("handoff timeout", func(e *zerolog.Event) {
				e.Int("partition", l.a.Partition).Int64("handoff_timeout_ms", l.p.cfg.HandoffTimeout.Milliseconds()).
					Msg("no new owner announced itself: released partition stops forwarding; its messages get no acknowledgement until one does")
			})
			return
		case <-l.q.ready:
			l.process(false)
			if l.cut && (l.data != nil || l.routed) {
				l.unsubscribeData()
				l.log.Warn().Int("recorded", len(l.recorded)).Msg("handoff record full: released partition stops forwarding until its new owner announces itself")
			}
		case m := <-l.announces:
			if l.newer(m) {
				l.cutover(m)
				return
			}
		}
	}
}

// cutover ends a handoff: it publishes a marker on the lane's own subscription and forwards
// everything that arrives before it, and for HandoffSettle after it; then it stops receiving,
// forwards what is still queued and answers the announcement m. The settle covers a message the
// server matched against the subscriptions before the new owner's existed and delivers only
// later: unsubscribed at once, the old owner would miss it too, and its publisher would get no
// responders.
func (l *lane) cutover(m *nats.Msg) {
	if !l.cut {
		l.marker = l.p.nonce(l.a)
		if l.routed {
			l.p.route(l, true, l.marker)
		}
		mk := nats.NewMsg(l.p.markerSubjectFor(l))
		mk.Header.Set(HeaderMarker, l.marker)
		if err := l.p.nc.PublishMsg(mk); err != nil {
			l.log.Warn().Err(err).Msg("publishing the handoff marker failed")
			l.markerSeen = true
		}
		timeout := time.NewTimer(l.p.cfg.AnswerTimeout)
		for !l.markerSeen && !l.cut {
			select {
			case <-l.q.ready:
				l.process(false)
			case <-timeout.C:
				l.log.Warn().Msg("the handoff marker did not come back in time: handing over without it")
				l.markerSeen = true
			}
		}
		timeout.Stop()
		settle := time.NewTimer(l.p.cfg.HandoffSettle)
		for settling := true; settling && !l.cut; {
			select {
			case <-l.q.ready:
				l.process(false)
			case <-settle.C:
				settling = false
			}
		}
		settle.Stop()
	}
	l.unsubscribeData()
	l.process(false) // what was queued before the unsubscribe
	l.answer(m, false)
	l.log.Debug().Int("forwarded_during_handoff", len(l.recorded)).Str("new_owner", m.Header.Get(hdrReplica)).
		Msg("partition handed over")
}

// answer tells the announcer of m which reply subjects this lane forwarded since it was released,
// in parts that fit a message.
func (l *lane) answer(m *nats.Msg, fenced bool) {
	nc := l.p.nc
	rev := uint64(0)
	if l.p.cfg.Revision != nil {
		rev = l.p.cfg.Revision()
	}
	// Everything forwarded has reached the server before the answer lets the new owner go. The
	// server reads a connection in order, so it would take the forwards first anyway; the flush
	// makes sure they left this client, and says so when the connection failed under them
	// (their publishers get no acknowledgement and retry). Stored they may not be yet: the
	// streams take them from their queues (docs/modes-and-layouts.md, a stale owner).
	if err := nc.FlushTimeout(l.p.cfg.AnswerTimeout); err != nil {
		l.log.Warn().Err(err).Msg("flushing the forwards before answering the new owner failed; answering all the same")
	}
	limit := int(min(nc.MaxPayload()/2, 256<<10))
	var parts [][]byte
	var part []byte
	for _, r := range l.recorded {
		if len(part) > 0 && len(part)+len(r)+1 > limit {
			parts, part = append(parts, part), nil
		}
		part = append(append(part, r...), '\n')
	}
	parts = append(parts, part)
	for i, body := range parts {
		a := nats.NewMsg(m.Reply)
		a.Data = body
		a.Header.Set(hdrEpoch, m.Header.Get(hdrEpoch))
		a.Header.Set(hdrRevision, strconv.FormatUint(rev, 10))
		a.Header.Set(hdrCount, strconv.Itoa(len(l.recorded)))
		if i == len(parts)-1 {
			a.Header.Set(hdrLast, "true")
		}
		if fenced {
			a.Header.Set(hdrFenced, "true")
		}
		if err := nc.PublishMsg(a); err != nil {
			l.log.Warn().Err(err).Msg("answering the new owner failed: what both forward is stored twice unless it carries a Nats-Msg-Id")
			return
		}
	}
	if err := nc.FlushTimeout(l.p.cfg.AnswerTimeout); err != nil {
		l.log.Debug().Err(err).Msg("flushing the handoff answer")
	}
}
