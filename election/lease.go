package election

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/kvcas"
)

// Lease is one partition owned by this replica, handed to [Work].
type Lease struct {
	// Partition is the partition this lease is for.
	Partition int
	// Epoch is the KV revision of lease.<p> when this replica claimed it. It grows with every
	// claim of the partition by anyone, so it is a fencing token; it does not change on renewal.
	Epoch uint64
	// Checked is, for a lease taken over from an owner judged dead ([Config.JudgedExpiry]),
	// what that owner's last write of it carried in its Kvmapper-Lease-Checked header
	// ([Config.Checked]), which [Config.Judge] accepted: the work must refuse that owner's
	// writes as it vouched (the lanes fence every stream it named). "" for any other claim.
	Checked string

	clock  func() time.Duration // the Elector's lease clock (Config.Clock); immutable
	expiry atomic.Int64         // reading of clock at which Valid turns false
}

// Valid reports whether this replica still holds the lease by its own lease clock
// (Config.Clock): it turns false once the send time of the last successful renewal (or of the
// claim) + LeaseTTL − Margin has passed, and at once when a renewal is refused or the lease has
// been handed over. The default clock counts time a process spends stopped (SIGSTOP) and, on
// Linux, time the machine spends suspended, so an owner sees false as soon as it runs again
// after a pause longer than its lease; the partition's context is cancelled at the holder's next
// timer, within RenewInterval. It is cheap (one clock reading) and safe for concurrent use.
func (l *Lease) Valid() bool {
	return l.clock() < time.Duration(l.expiry.Load())
}

// remaining returns how long the lease stays valid, ≤ 0 when it is not.
func (l *Lease) remaining() time.Duration {
	return time.Duration(l.expiry.Load()) - l.clock()
}

// extend moves the expiry to sent + d unless it is already later; sent is a reading of the
// lease clock. Only the holder calls it.
func (l *Lease) extend(sent, d time.Duration) {
	at := int64(sent + d)
	if at > l.expiry.Load() {
		l.expiry.Store(at)
	}
}

// revoke makes Valid false from now on.
func (l *Lease) revoke() { l.expiry.Store(math.MinInt64) }

// exitKind says how a holder ended.
type exitKind int

const (
	exitReleased  exitKind = iota // handed over on request; lease deleted
	exitFailed                    // Work returned on its own; lease deleted
	exitLost                      // lease lost; Work has returned
	exitAbandoned                 // Work did not return within ReleaseTimeout; lease left to expire
)

// exit is what a holder reports to the Elector's loop when it ends.
type exit struct {
	p    int
	kind exitKind
}

// holder runs one owned partition: it starts Work, renews the lease, fences itself when the lease
// clock runs out, and hands the partition over on request. All fields but release are owned by
// the holder's goroutine once it runs.
type holder struct {
	e       *Elector
	lease   *Lease
	key     string
	subject string
	rev     uint64 // latest revision of the lease key, for compare-and-set
	// pending says a renewal expecting rev has been sent, first at pendingSince by the lease
	// clock: a renewal adopt finds stored at a later revision was one of those, sent no earlier.
	pending      bool
	pendingSince time.Duration
	release      chan struct{} // closed by the Elector's loop to ask for a handover
	// releasing is set by the Elector's loop when it closes release; only the loop uses it.
	releasing bool
	// keepUntil, set for partitions claimed past Grace against their rank, delays handing them
	// back to the member they rank first for; only the Elector's loop uses it.
	keepUntil time.Time
	// gone is set by run once the lease is lost, while Work may still be returning (a fenced
	// lane drains its publishes for up to its DrainTimeout): the Elector's loop then no longer
	// counts the partition as this replica's share.
	gone atomic.Bool
}

// run owns the partition until the lease is released, lost or abandoned, and reports how it
// ended. It returns only after Work has returned, or after ReleaseTimeout once asked to stop.
func (h *holder) run(parent context.Context) exit {
	e, l := h.e, h.lease
	log := e.log.With().Int("partition", l.Partition).Uint64("epoch", l.Epoch).Logger()

	// Work's context keeps parent's values but not its cancellation: only the lease ends it.
	wctx, cancel := context.WithCancelCause(context.WithoutCancel(parent))
	defer cancel(ErrReleased)
	workDone := make(chan error, 1)
	go func() { workDone <- e.work(wctx, l) }()

	renew := time.NewTicker(e.cfg.RenewInterval)
	defer renew.Stop()
	expiry := time.NewTimer(l.remaining())
	defer expiry.Stop()
	renewC, expiryC := renew.C, expiry.C
	releaseC, stoppingC := h.release, e.stopping
	var deadline <-chan time.Time
	var lost, releasing bool

	lose := func(reason string, err error) {
		lost = true
		h.gone.Store(true)
		l.revoke()
		cancel(ErrLeaseLost)
		renewC, expiryC = nil, nil
		log.Warn().Err(err).Str("reason", reason).Str("old_owner", e.cfg.ReplicaID).Msg("partition lease lost")
	}
	startRelease := func() {
		if !lost && !releasing {
			releasing = true
			cancel(ErrReleased)
		}
		if deadline == nil {
			deadline = time.After(e.cfg.ReleaseTimeout)
		}
	}

	for {
		select {
		case <-renewC:
			switch err := h.renew(); {
			case err == nil:
			case kvcas.IsConflict(err):
				lose("renewal refused", err)
				continue
			default:
				log.Debug().Err(err).Msg("lease renewal failed")
			}
			if !l.Valid() {
				lose("lease clock ran out", nil)
				continue
			}
			expiry.Reset(l.remaining())
		case <-expiryC:
			if !l.Valid() {
				lose("lease clock ran out", nil)
				continue
			}
			expiry.Reset(l.remaining())
		case <-releaseC:
			releaseC = nil
			if !lost {
				startRelease()
			}
		case <-stoppingC:
			stoppingC = nil
			startRelease()
		case err := <-workDone:
			switch {
			case lost:
				return exit{p: l.Partition, kind: exitLost}
			case releasing:
				if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, ErrReleased) {
					log.Debug().Err(err).Msg("work returned an error on release")
				}
				h.delete()
				return exit{p: l.Partition, kind: exitReleased}
			case errors.Is(err, ErrLeaseLost):
				// The work found itself fenced by a newer owner (its output refused it): the
				// lease is that owner's now, and not this holder's to delete.
				lose("work fenced by a newer owner", err)
				return exit{p: l.Partition, kind: exitLost}
			default:
				cancel(ErrReleased)
				log.Error().Err(err).Msg("work returned while owning the partition")
				h.delete()
				return exit{p: l.Partition, kind: exitFailed}
			}
		case <-deadline:
			l.revoke()
			cancel(ErrReleased)
			log.Error().Int64("release_timeout_ms", ms(e.cfg.ReleaseTimeout)).
				Msg("work did not return in time; abandoning it and leaving the lease to expire")
			return exit{p: l.Partition, kind: exitAbandoned}
		}
	}
}

// epochHeader names, on every renewal, the claim it renews by that claim's epoch, so that a holder
// can recognise its own renewal in the stored lease when the answer to it was lost. The value
// stays the bare replica id, which watchers read as the owner; an id alone cannot tell this claim
// from another one by a process with the same id.
const epochHeader = "Kvmapper-Lease-Epoch"

// checkedHeader carries, on a renewal, what the lease's work vouches for ([Config.Checked]):
// other replicas judge a silent owner dead early only when its last write carried what their
// [Config.Judge] accepts.
const checkedHeader = "Kvmapper-Lease-Checked"

// renew extends the lease key's TTL with a compare-and-set on its latest revision. kv.Update
// and kv.Put would drop the per-key TTL, so it publishes to the key's subject itself. It waits
// for an answer until the next renewal is due, and never past the lease clock, so that after an
// answer lost on the way (a timeout, a reconnect) there is time for another attempt; that
// attempt's conflict with the lost renewal is resolved by adopt. A conflict it cannot resolve
// is returned as one (the lease is lost); a conflict whose cause cannot be read is returned as
// another error, and the lease holds until the next renewal or its clock says otherwise.
func (h *holder) renew() error {
	e, l := h.e, h.lease
	timeout := min(l.remaining(), renewalTimeout(e.cfg))
	if timeout <= 0 {
		return nil // the caller sees !Valid and fences
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	sent, ack, err := h.publishRenewal(ctx)
	if kvcas.IsConflict(err) {
		switch adopted, rerr := h.adopt(ctx); {
		case rerr != nil:
			return fmt.Errorf("election: renewal of %s conflicted, and reading the lease back failed: %w", h.key, rerr)
		case adopted:
			sent, ack, err = h.publishRenewal(ctx)
		}
	}
	if err != nil {
		return err
	}
	h.rev, h.pending = ack.Sequence, false
	e.ownWriteAcked(ack.Sequence)
	l.extend(sent, e.cfg.LeaseTTL-e.cfg.Margin)
	e.log.Debug().Int("partition", l.Partition).Uint64("revision", ack.Sequence).Msg("lease renewed")
	return nil
}

// renewalTimeout is how long a renewal waits for its answer: until the next is due, or a fifth
// of the TTL when that is longer. A long TTL leaves the time to wait for a server that answers
// slowly (a replicated bucket under load, or just after electing its leader), instead of
// sending renewal after renewal that the server refuses while the first is still in process.
//
// With JudgedExpiry it is one renew interval: the others take a lease over after JudgedExpiry of
// writable time without a renewal, and after an election the first renewal must not wait out an
// answer that a dead leader will never send.
func renewalTimeout(cfg Config) time.Duration {
	if cfg.JudgedExpiry > 0 {
		return cfg.RenewInterval
	}
	return max(cfg.RenewInterval, cfg.LeaseTTL/5)
}

// publishRenewal sends one renewal on the holder's revision and returns its send time by the
// lease clock and the server's answer.
func (h *holder) publishRenewal(ctx context.Context) (time.Duration, *jetstream.PubAck, error) {
	e := h.e
	msg := nats.NewMsg(h.subject)
	msg.Data = []byte(e.cfg.ReplicaID)
	msg.Header.Set(epochHeader, strconv.FormatUint(h.lease.Epoch, 10))
	if e.cfg.Checked != nil {
		if c := e.cfg.Checked(h.lease.Partition, h.lease.Epoch); c != "" {
			msg.Header.Set(checkedHeader, c)
		}
	}
	sent := e.cfg.Clock()
	if !h.pending {
		h.pending, h.pendingSince = true, sent
	}
	ack, err := e.js.PublishMsg(ctx, msg,
		jetstream.WithMsgTTL(e.cfg.LeaseTTL),
		jetstream.WithExpectLastSequencePerSubject(h.rev))
	return sent, ack, err
}

// adopt handles a compare-and-set conflict on the lease key that may be the holder's own doing:
// a renewal the server applied but whose answer was lost (a timeout, a reconnect) leaves the
// holder a revision behind, and its next renewal or its release would fail. If the lease still
// holds by the holder's clock and the stored lease is a renewal of this very claim (this
// replica's id as the value, the claim's epoch in its header, a revision past the holder's), the
// holder takes that revision as its own and adopt reports true. That renewal extends the lease
// too: it was one the holder sent expecting its revision (the server applies no other), so at
// or after the first of those (pendingSince), and the server's TTL runs from no earlier. Anything else stored (a delete,
// an expiry marker, another replica's claim, a claim by another process with the same id) means
// the lease is lost, and adopt reports false. It reads the lease from the bucket's leader: a
// replica that has not applied the latest renewal yet would show an older revision, and a live
// lease would be given up. A failed read is returned as an error: it says nothing of the lease.
func (h *holder) adopt(ctx context.Context) (bool, error) {
	e, l := h.e, h.lease
	if !l.Valid() {
		return false, nil
	}
	m, err := h.stored(ctx)
	if errors.Is(err, kvcas.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		e.log.Debug().Err(err).Int("partition", l.Partition).Msg("reading the lease after a conflict failed")
		return false, err
	}
	if m.Sequence <= h.rev || string(m.Data) != e.cfg.ReplicaID || kvcas.Deleted(m) ||
		m.Header.Get(epochHeader) != strconv.FormatUint(l.Epoch, 10) {
		return false, nil
	}
	e.log.Info().Int("partition", l.Partition).Uint64("epoch", l.Epoch).Uint64("revision", m.Sequence).
		Uint64("expected", h.rev).Msg("adopting a lease renewal whose answer was lost")
	if h.pending {
		l.extend(h.pendingSince, e.cfg.LeaseTTL-e.cfg.Margin)
	}
	h.rev, h.pending = m.Sequence, false
	return true, nil
}

// stored reads the lease key's last message with its headers, which jetstream.KeyValue does not
// show, from the leader of the bucket's stream.
func (h *holder) stored(ctx context.Context) (*jetstream.RawStreamMsg, error) {
	m, err := kvcas.Latest(ctx, h.e.js, h.e.kv.Bucket(), h.key)
	if err != nil {
		return nil, fmt.Errorf("election: reading %s: %w", h.key, err)
	}
	return m, nil
}

// delete removes the lease key if it is still at the revision this holder last wrote (or at a
// renewal of its own whose answer was lost), then makes the lease invalid.
func (h *holder) delete() {
	e := h.e
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.LeaseTTL)
	defer cancel()
	err := e.kv.Delete(ctx, h.key, jetstream.LastRevision(h.rev))
	if kvcas.IsConflict(err) {
		if adopted, _ := h.adopt(ctx); adopted {
			err = e.kv.Delete(ctx, h.key, jetstream.LastRevision(h.rev))
		}
	}
	h.lease.revoke()
	if err != nil {
		e.log.Warn().Err(err).Int("partition", h.lease.Partition).Msg("deleting released lease failed; it will expire")
		return
	}
	e.log.Debug().Int("partition", h.lease.Partition).Uint64("epoch", h.lease.Epoch).
		Str("old_owner", e.cfg.ReplicaID).Str("new_owner", "").Msg("partition released")
}
