package kv

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
)

// ErrFutureRevision is wrapped by [AsOf]'s error for a revision the bucket has not written yet.
var ErrFutureRevision = errors.New("kv: revision not written yet")

// Snapshot is the groups table as it was at one revision of the bucket, rebuilt from the
// bucket's history by [AsOf]. It is immutable and safe for concurrent use.
type Snapshot struct {
	// Revision is the revision the table is as of: every write up to it is applied, none after.
	Revision uint64
	// Last is the bucket's last revision when it was read.
	Last uint64
	// History is how many values per key the bucket keeps.
	History int
	// Lost counts the writes at or before Revision that the bucket's stream no longer holds
	// (replaced beyond History, purged, expired). Zero means the table is exact.
	Lost uint64

	entries map[string]Entry
	unknown []string // sorted
}

// Lookup returns what the table held for device at Revision; ok is false when it held nothing
// (no key, or a deleted one), and also for a device of [Snapshot.Unknown].
func (s *Snapshot) Lookup(device string) (e Entry, ok bool) {
	e, ok = s.entries[device]
	return e, ok
}

// Len returns the number of devices the table held at Revision.
func (s *Snapshot) Len() int { return len(s.entries) }

// Unknown reports whether the value device had at Revision may be gone from the bucket's history:
// its every write at or before Revision was removed, so that the table cannot say what it held.
func (s *Snapshot) Unknown(device string) bool {
	_, found := slices.BinarySearch(s.unknown, device)
	return found
}

// UnknownKeys returns the devices of [Snapshot.Unknown], sorted. The caller must not change it.
func (s *Snapshot) UnknownKeys() []string { return s.unknown }

// keyHistory is what AsOf keeps of one key's surviving writes.
type keyHistory struct {
	at       Entry // the last write at or before the revision, if any
	atOK     bool  // there is one
	atGone   bool  // and it deleted or purged the key
	count    int   // writes the stream holds for the key
	firstCut bool  // the first of them wiped what came before (a purge, an expiry marker)
}

// AsOf rebuilds the table of bucket as it was at revision rev (0: before the first write, an
// empty table) from the bucket's history: it reads the bucket's stream, KV_<bucket>, from its
// first message to its last, and applies every write up to rev, as a watch would have. Values are
// decoded and checked with schema (nil: subjects.GroupSchema) as a [Table] with that schema does
// (Entry.Invalid for a value its templates cannot use).
//
// A bucket keeps History values per key, so the value a key had at rev may be gone. AsOf tells
// which keys: those whose every write the stream still holds comes after rev, when the key has
// History of them (older ones were dropped), or the first of them is a purge or an expiry marker
// (which removed what came before), or the stream also removes messages by age, count, size or
// per-message TTL. They are reported by [Snapshot.Unknown]; when Lost is zero (every write up to
// rev is still there) there are none. A key whose writes were all removed, its delete or purge
// marker included (a stream purge, the bucket's TTL without markers, PurgeDeletes), leaves no
// trace and reads as absent.
//
// AsOf returns an error wrapping [ErrFutureRevision] for a revision beyond the bucket's last,
// and one wrapping jetstream.ErrBucketNotFound when the bucket does not exist. It blocks while it
// reads; ctx bounds it.
func AsOf(ctx context.Context, js jetstream.JetStream, bucket string, rev uint64, schema *subjects.Schema) (*Snapshot, error) {
	stream := subjects.BucketStream(bucket)
	s, err := js.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("kv: bucket %s: %w", bucket, jetstream.ErrBucketNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("kv: reading bucket %s: %w", bucket, err)
	}
	info := s.CachedInfo()
	st, cfg := info.State, info.Config
	if rev > st.LastSeq {
		return nil, fmt.Errorf("%w: revision %d of bucket %s; its last is %d", ErrFutureRevision, rev, bucket, st.LastSeq)
	}
	snap := &Snapshot{Revision: rev, Last: st.LastSeq, History: int(cfg.MaxMsgsPerSubject), entries: map[string]Entry{}}
	keys := map[string]*keyHistory{}
	var kept uint64 // writes at or before rev the stream holds
	if st.Msgs > 0 {
		prefix := "$KV." + bucket + "."
		err := readAll(ctx, js, stream, st.LastSeq, func(m jetstream.Msg, seq uint64) {
			key := m.Subject()
			if len(key) <= len(prefix) {
				return
			}
			key = key[len(prefix):]
			h := keys[key]
			if h == nil {
				h = &keyHistory{}
				keys[key] = h
			}
			hdr := m.Headers()
			if h.count == 0 {
				h.firstCut = hdr.Get(jetstream.MsgRollup) != "" || hdr.Get(jetstream.MarkerReasonHeader) != ""
			}
			h.count++
			if seq > rev {
				return
			}
			kept++
			h.atOK = true
			h.atGone = removes(hdr)
			if !h.atGone {
				h.at = DecodeEntry(schema, m.Data(), seq)
			}
		})
		if err != nil {
			return nil, fmt.Errorf("kv: reading the history of bucket %s: %w", bucket, err)
		}
	}
	snap.Lost = rev - kept // kept counts distinct sequences up to rev
	// Streams that remove messages by age, count, size or per-message TTL may have removed any
	// key's older writes without leaving a mark.
	trims := cfg.MaxAge > 0 || cfg.MaxMsgs > 0 || cfg.MaxBytes > 0 || cfg.AllowMsgTTL
	for key, h := range keys {
		switch {
		case h.atOK && !h.atGone:
			snap.entries[key] = h.at
		case h.atOK:
		case snap.Lost > 0 && ((snap.History > 0 && h.count >= snap.History) || h.firstCut || trims):
			snap.unknown = append(snap.unknown, key)
		}
	}
	slices.Sort(snap.unknown)
	return snap, nil
}

// removes reports whether a bucket message with these headers deletes or purges its key, as
// nats.go reads them.
func removes(hdr nats.Header) bool {
	if len(hdr) == 0 {
		return false
	}
	switch hdr.Get("KV-Operation") {
	case "DEL", "PURGE":
		return true
	}
	switch hdr.Get(jetstream.MarkerReasonHeader) {
	case "MaxAge", "Purge", "Remove":
		return true
	}
	return false
}

// readAll reads stream from its first message through sequence last with an ordered consumer,
// calling f for each message in order. It stops early when nothing is left to read before last
// (messages removed while it reads).
func readAll(ctx context.Context, js jetstream.JetStream, stream string, last uint64, f func(m jetstream.Msg, seq uint64)) error {
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return err
	}
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	for {
		m, err := it.Next(jetstream.NextMaxWait(time.Second))
		if errors.Is(err, nats.ErrTimeout) {
			ci, err := cons.Info(ctx)
			if err != nil {
				return err
			}
			if ci.NumPending == 0 {
				return nil
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			return err
		}
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		if md.Sequence.Stream > last {
			return nil
		}
		f(m, md.Sequence.Stream)
		if md.Sequence.Stream == last || md.NumPending == 0 {
			return nil
		}
	}
}
