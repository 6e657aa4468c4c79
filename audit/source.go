package audit

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// Range is the audited part of one stream that holds INCOMING messages: INCOMING in the
// single-stream layout, or one partition stream INCOMING-<p>.
type Range struct {
	Stream string `json:"stream"`
	First  uint64 `json:"first"`    // first sequence of the audited range
	Last   uint64 `json:"last"`     // last sequence of the audited range; below First when empty
	Count  uint64 `json:"messages"` // messages audited: the range minus the sequences deleted then
}

// source is one stream that holds INCOMING messages and what the audit found of its range.
// Readers mark sequences from their own goroutines: the bitmaps are safe for that.
type source struct {
	Range
	idPrefix string // "<stream>:<incarnation>:", see wire.MsgIDPrefix
	// legacyPrefix is "<INCOMING>:", the Nats-Msg-Id prefix written before ids named the
	// incarnation of INCOMING; such ids stored after INCOMING was created are taken as its own,
	// those stored before as an earlier incarnation's. "" for partition streams, which came later.
	legacyPrefix string
	created      int64  // when the stream was created, Unix nanoseconds
	seen         bitmap // seq-first, set when a copy is read
	deleted      bitmap // seq-first, deleted at the start; nil when there were none
}

// openSource takes the state of stream name: its range and the sequences deleted in it.
func openSource(ctx context.Context, js jetstream.JetStream, name string, legacy bool) (*source, error) {
	info, err := streamInfo(ctx, js, name, nil, jetstream.WithDeletedDetails(true))
	if err != nil {
		return nil, fmt.Errorf("audit: reading the state of stream %s: %w", name, err)
	}
	st := info.State
	src := &source{Range: Range{Stream: name}, idPrefix: wire.MsgIDPrefix(name, wire.Incarnation(info.Created)),
		created: info.Created.UnixNano()}
	if legacy {
		src.legacyPrefix = wire.LegacyMsgIDPrefix(name)
	}
	if st.Msgs == 0 {
		return src, nil
	}
	src.First, src.Last = st.FirstSeq, st.LastSeq
	n := src.Last - src.First + 1
	src.seen = newBitmap(n)
	src.Count = n
	if st.NumDeleted > 0 {
		if len(st.Deleted) < st.NumDeleted {
			return nil, fmt.Errorf("audit: stream %s reports %d deleted messages but listed %d; cannot tell them from missing ones",
				name, st.NumDeleted, len(st.Deleted))
		}
		src.deleted = newBitmap(n)
		for _, seq := range st.Deleted {
			if seq >= src.First && seq <= src.Last && !src.deleted.set(seq-src.First) {
				src.Count--
			}
		}
	}
	return src, nil
}

// sourceOf returns the source a Nats-Msg-Id names and the sequence in it, or false for an id
// that names no audited stream, or another incarnation of one. stored is when the message
// carrying it was stored (Unix nanoseconds): an id without incarnation counts as INCOMING's own
// only when it was stored after INCOMING was created.
func (a *auditor) sourceOf(id string, stored int64) (*source, uint64, bool) {
	src := a.sources[0]
	if len(a.sources) > 1 {
		// "<stream>:<incarnation>:<seq>": the stream name may hold colons, the others not.
		i := strings.LastIndexByte(id, ':')
		if i < 0 {
			return nil, 0, false
		}
		j := strings.LastIndexByte(id[:i], ':')
		if j < 0 {
			return nil, 0, false
		}
		if src = a.byName[id[:j]]; src == nil {
			return nil, 0, false
		}
	}
	seq, ok := wire.ParseMsgID(id, src.idPrefix)
	if !ok && src.legacyPrefix != "" && stored >= src.created {
		seq, ok = wire.ParseMsgID(id, src.legacyPrefix)
	}
	return src, seq, ok
}

// mark records a copy of seq of src and reports whether it is in the audited range and whether
// a copy had been seen before.
func (a *auditor) mark(src *source, seq uint64) (inRange, dup bool) {
	if seq < src.First || seq > src.Last {
		return false, false
	}
	i := seq - src.First
	if src.seen.set(i) {
		return true, true
	}
	if src.deleted == nil || !src.deleted.get(i) {
		if a.missing.Add(-1) == 0 {
			a.allFound()
		}
	}
	return true, false
}

// missingCount returns how many sequences of the audited range have no copy.
func (src *source) missingCount() uint64 {
	if src.Last < src.First || src.seen == nil {
		return 0
	}
	n := src.Last - src.First + 1
	got := src.seen.count()
	if src.deleted != nil {
		got = src.seen.countAndNot(src.deleted) + src.deleted.count()
	}
	return n - got
}

// missingFindings lists up to max missing sequences of src, with the subject each has in the
// stream (one GetMsg per example).
func (a *auditor) missingFindings(ctx context.Context, js jetstream.JetStream, src *source, max int) []Finding {
	var l []Finding
	if src.seen == nil || max <= 0 {
		return nil
	}
	s, err := js.Stream(ctx, src.Stream)
	n := src.Last - src.First + 1
	for i := uint64(0); i < n && len(l) < max; i++ {
		i = src.seen.nextClear(i, n)
		if i >= n {
			break
		}
		if src.deleted != nil && src.deleted.get(i) {
			continue
		}
		seq := src.First + i
		f := Finding{Kind: KindMissing, Seq: seq, Stream: src.Stream, StreamSeq: seq,
			Detail: fmt.Sprintf("%s:%d is in neither %s nor %s", src.Stream, seq, a.cfg.Outgoing, a.cfg.Unmapped)}
		if err == nil {
			if m, gerr := s.GetMsg(ctx, seq); gerr == nil {
				var fl subjects.Fields
				if a.cfg.Layout.Parse(m.Subject, &fl) == nil {
					f.Device = fl.Device()
				}
				f.Detail += " (subject " + m.Subject + ")"
			} else if errors.Is(gerr, jetstream.ErrMsgNotFound) {
				f.Detail += " (deleted from " + src.Stream + " since the audit started)"
			}
		}
		l = append(l, f)
	}
	return l
}
