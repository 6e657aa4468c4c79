package election

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/wire"
)

// claimHeader carries, on every claim, a nonce drawn for that claim alone, so that a claimer
// whose answer was lost can recognise its claim in the stored lease. The value stays the bare
// replica id, which watchers read as the owner; an id alone cannot tell this claim from one by
// another process with the same id (or by a kvmapper that sends no nonce).
const claimHeader = "Kvmapper-Lease-Claim"

// errNoAnswer is wrapped by the error of a claim whose outcome is unknown: its answer did not
// come (a timeout, a reconnect, the key busy with another write) and reading the lease back did
// not show it stored.
var errNoAnswer = errors.New("election: no answer to the claim")

// unanswered is a claim of a partition whose outcome is not known yet: the server may have
// stored it, or may still store it (a write in process, or one nats.go resends from its
// reconnect buffer), and then the lease names this replica while it holds no lease for it.
// While the claim's own lease clock runs, the Elector's loop tries it again (see [Elector.claim])
// until it finds it stored, or finds the partition held by someone else. Owned by the loop.
type unanswered struct {
	nonce string
	// sent is the lease clock's reading when the first write carrying nonce was sent: every
	// write of this claim was stored at or after it.
	sent    time.Duration
	planned bool
	slot    slot      // the partition as the view showed it at the first attempt, for the log
	retry   time.Time // when the loop tries it again
	// over is the revision a takeover writes over: the last write of a lease judged dead
	// ([Config.JudgedExpiry]); 0 for a claim of a free partition. checked is what that write
	// carried in its checkedHeader, for the Lease.
	over    uint64
	checked string
}

// live reports whether a lease stored under c would still be valid by the lease clock.
func (e *Elector) live(c unanswered) bool {
	return e.cfg.Clock() < c.sent+e.cfg.LeaseTTL-e.cfg.Margin
}

// claim tries to create partition p's lease and, on success, starts its holder. planned says
// whether [Plan] asked for it (within the quota) rather than Grace.
//
// A claim whose answer is lost may have been stored: then lease.<p> names this replica, nobody
// else can claim p until it expires, and nobody would serve p meanwhile. So a claim that gets no
// answer reads the lease back from the bucket's leader, and a claim whose outcome stays unknown
// is kept (with its nonce and first send time) and tried again with the same nonce, every
// RenewInterval while its lease clock runs. A lease found stored with this replica's id and the
// claim's nonce is taken as if its answer had come, with its revision as the epoch.
//
// That keeps I3 (one writer per partition). The server stored that write only because the key
// was absent, deleted or expired when it applied it (its expected last sequence was 0 or a
// delete or expiry marker), just as for a claim whose answer arrives: no other owner's lease
// was alive then. From then on the key exists, and until it expires or is deleted no other
// claim can be stored, and nobody renews it but the holder that knows its revision: the read
// shows it is still the latest write of the key, so nobody has claimed p since. The nonce is
// drawn for this claim and sent by nobody else, so the write is this claim's, sent no earlier
// than c.sent; the server's TTL runs from its storage, and the lease clock from c.sent, so the
// holder stops at least Margin before anyone else could claim p, as for any claim. A claim found
// only after its clock has run out is not taken: the lease is left to expire.
func (e *Elector) claim(ctx context.Context, p int, s slot, planned bool) {
	key := wire.LeaseKey(p)
	c, again := e.unanswered[p]
	delete(e.unanswered, p)
	if !again || !e.live(c) {
		c = unanswered{nonce: rand.Text(), sent: e.cfg.Clock(), planned: planned, slot: s}
		if s.owner != "" {
			// A lease judged dead: taken over only if nobody wrote it since.
			c.over = s.rev
			if a := e.adverts[p]; a.rev == s.rev {
				c.checked = a.checked
			}
		}
	}
	// A claim tried again may find the view showing its own lease: log what it was claimed from.
	planned, s = c.planned || planned, c.slot
	rev, sent, found, err := e.create(ctx, key, c)
	if err != nil {
		if errors.Is(err, errNoAnswer) && e.live(c) && ctx.Err() == nil {
			c.retry = time.Now().Add(e.cfg.RenewInterval)
			e.unanswered[p] = c
		}
		e.log.Debug().Err(err).Int("partition", p).Msg("claim failed")
		return
	}
	l := &Lease{Partition: p, Epoch: rev, Checked: c.checked, clock: e.cfg.Clock}
	l.extend(sent, e.cfg.LeaseTTL-e.cfg.Margin)
	h := &holder{e: e, lease: l, key: key, subject: e.leasePrefix + key, rev: rev, release: make(chan struct{})}
	if found && l.Valid() && l.remaining() <= e.cfg.RenewInterval {
		// Found late in its clock, the lease would run out before the holder's first renewal.
		if err := h.renew(); err != nil {
			e.log.Debug().Err(err).Int("partition", p).Msg("renewing a claim whose answer was lost failed")
		}
	}
	if !l.Valid() {
		e.log.Info().Int("partition", p).Uint64("revision", rev).
			Msg("found a claim whose answer was lost too late to take it; leaving it to expire")
		return
	}
	if !planned {
		h.keepUntil = time.Now().Add(graceHold * e.cfg.LeaseTTL)
	}
	e.holders[p] = h
	e.publishOwned()
	old := s.lastOwner
	if c.over != 0 {
		old = s.owner // taken over from an owner judged dead
	}
	unowned := time.Since(s.freeSince)
	e.log.Debug().Int("partition", p).Str("old_owner", old).Str("new_owner", e.cfg.ReplicaID).
		Uint64("epoch", rev).Int64("unowned_ms", ms(unowned)).Bool("planned", planned).
		Bool("answer_lost", found).Bool("taken_over", c.over != 0).Msg("partition claimed")
	e.claimed = append(e.claimed, claimed{p: p, from: old, unowned: unowned, answerLost: found, takenOver: c.over != 0})
	e.goroutines.Go(func() { e.exits <- h.run(ctx) })
}

// create writes lease key under claim c, as kv.Create would (only if the key is absent, deleted
// or expired, with the lease TTL), with c's nonce in [claimHeader]; it waits up to RenewInterval
// for each answer. It returns the lease's revision and the lease clock's reading when the write
// stored there was sent: that of an acknowledged write, or c.sent, with found true, for a write
// of c read back rather than acknowledged (an answer lost now or in an earlier attempt). It
// returns an error wrapping [ErrLeaseHeld] when another claim holds the key, and one wrapping
// errNoAnswer when c may have been stored or may still be.
func (e *Elector) create(ctx context.Context, key string, c unanswered) (rev uint64, sent time.Duration, found bool, err error) {
	// Like kv.Create, one timeout covers the write, the read of a marker it conflicts with and
	// the write on top of it, so that a slow server holds the loop for at most RenewInterval
	// per claim; an answer lost costs one more for the read back.
	wctx, cancel := context.WithTimeout(ctx, e.cfg.RenewInterval)
	defer cancel()
	sent = e.cfg.Clock()
	rev, err = e.publishClaim(wctx, key, c.nonce, c.over)
	if err == nil {
		return rev, sent, false, nil
	}
	// A conflict is a key that holds something: a lease (perhaps this claim's, from an earlier
	// attempt), or a delete or expiry marker, on top of which a claim may be written. A write
	// refused as in process wrote nothing either. Any other error but the server's refusal may
	// hide a stored claim.
	refused := kvcas.IsConflict(err) || kvcas.InProcess(err)
	if !refused && !unanswerable(err) {
		return 0, 0, false, fmt.Errorf("election: claiming %s: %w", key, err)
	}
	rctx := wctx
	if !refused {
		if ctx.Err() != nil {
			return 0, 0, false, fmt.Errorf("%w: claiming %s: %w", errNoAnswer, key, err)
		}
		// The write's timeout has likely run out waiting for the answer.
		var rcancel context.CancelFunc
		rctx, rcancel = context.WithTimeout(ctx, e.cfg.RenewInterval)
		defer rcancel()
	}
	m, rerr := kvcas.Latest(rctx, e.js, e.kv.Bucket(), key)
	switch {
	case rerr == nil && !kvcas.Deleted(m) && string(m.Data) == e.cfg.ReplicaID && m.Header.Get(claimHeader) == c.nonce:
		return m.Sequence, c.sent, true, nil
	case rerr != nil && !errors.Is(rerr, kvcas.ErrNotFound):
		return 0, 0, false, fmt.Errorf("%w: claiming %s: %w; reading it back: %w", errNoAnswer, key, err, rerr)
	case rerr == nil && !kvcas.Deleted(m):
		// Someone else's lease is the key's latest write: this claim was not stored, and cannot
		// be any more (it expected an earlier last sequence).
		return 0, 0, false, fmt.Errorf("%w: %s held by %q at revision %d: %w", ErrLeaseHeld, key, m.Data, m.Sequence, err)
	case !refused || rerr != nil:
		// Nothing stored, or a delete or an expiry marker, but the claim may still be in
		// process: try again later, with the same nonce.
		return 0, 0, false, fmt.Errorf("%w: claiming %s: %w", errNoAnswer, key, err)
	}
	// Refused by a delete or an expiry marker: claim on top of it.
	sent = e.cfg.Clock()
	rev, err = e.publishClaim(wctx, key, c.nonce, m.Sequence)
	switch {
	case err == nil:
		return rev, sent, false, nil
	case kvcas.IsConflict(err):
		return 0, 0, false, fmt.Errorf("%w: claiming %s: %w", ErrLeaseHeld, key, err)
	case kvcas.InProcess(err) || unanswerable(err):
		return 0, 0, false, fmt.Errorf("%w: claiming %s: %w", errNoAnswer, key, err)
	}
	return 0, 0, false, fmt.Errorf("election: claiming %s: %w", key, err)
}

// unanswerable reports whether err, from a write, may hide a write the server stored: anything
// but the server's refusal (an API error) or nobody listening.
func unanswerable(err error) bool {
	var apiErr *jetstream.APIError
	return !errors.As(err, &apiErr) && !errors.Is(err, jetstream.ErrNoStreamResponse) && !errors.Is(err, nats.ErrNoResponders)
}

// publishClaim writes the lease key with this replica's id, nonce in [claimHeader] and the lease
// TTL, if the key's last revision is last (0: none), and returns the revision written.
func (e *Elector) publishClaim(ctx context.Context, key, nonce string, last uint64) (uint64, error) {
	msg := nats.NewMsg(e.leasePrefix + key)
	msg.Data = []byte(e.cfg.ReplicaID)
	msg.Header.Set(claimHeader, nonce)
	ack, err := e.js.PublishMsg(ctx, msg,
		jetstream.WithMsgTTL(e.cfg.LeaseTTL),
		jetstream.WithExpectLastSequencePerSubject(last))
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// retryUnanswered tries again the claims whose outcome is unknown and whose time has come, and
// forgets those whose lease clock has run out; it returns when the next is due (zero if none).
// A partition whose lease names this replica while it holds none shows in the view as owned
// (in transit) and is never claimed by [Plan] or Grace before the lease expires, so this is
// what takes a stored claim whose read-back failed.
func (e *Elector) retryUnanswered(ctx context.Context, now time.Time, slots []slot) time.Time {
	var next time.Time
	for p, c := range e.unanswered {
		if _, held := e.holders[p]; held || !e.live(c) {
			delete(e.unanswered, p)
			continue
		}
		if now.Before(c.retry) {
			if next.IsZero() || c.retry.Before(next) {
				next = c.retry
			}
			continue
		}
		if ctx.Err() != nil {
			break
		}
		e.claim(ctx, p, slots[p], c.planned)
		if c, ok := e.unanswered[p]; ok && (next.IsZero() || c.retry.Before(next)) {
			next = c.retry
		}
	}
	return next
}
