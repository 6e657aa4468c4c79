package lanes

// A reorder (I1) is a message stored after a later message of its device, in the same output
// stream: `kvmapper verify` counts them so, and so does [Stats].Reorders. The server refuses
// single messages only under duress (an ingest queue over 100k, a stream without a leader), and
// a lane keeps its window far below that; if it happens anyway, the refused message is resent
// behind the later one, by this lane or, when the lane stopped first, by the partition's next
// owner. Either way it must not be silent.
//
// The count is exact because it compares what the output stream says, not what the lane
// guesses: every acknowledgement carries the stream sequence the message is stored at, also
// for a duplicate, where it is the sequence of the copy stored first. A message is counted by
// the lane it was acknowledged to as new: it is stored once, so it is counted at most once
// across replicas, and a late acknowledgement (of a publish that timed out but was stored)
// counts nothing, because the resend then reads as the duplicate it is.

// maxWindow is the largest MaxInFlight: no lane of any replica ever has more publishes in flight.
const maxWindow = 50_000

// reorderKey names a device's messages in one output stream.
type reorderKey struct {
	device string
	stream int // streamOf: OUTGOING, UNMAPPED or PARKED
}

// reorders looks, while a message could still have been stored before an earlier one of its
// device, at each message in stream order as it leaves the lane's queue. Only then: a message
// sent on the connection after every earlier one of its partition was stored, or sent after
// them with no failure in between, is stored after them. So it looks after resends and after a
// takeover, and keeps nothing the rest of the time.
type reorders struct {
	// first is the lowest stream sequence each output stream (OUTGOING, UNMAPPED, PARKED) acknowledged
	// to this lane as new, 0 before any. Earlier owners stored everything of theirs before this
	// lane stored anything (they stop before their lease ends, and this lane claimed it after),
	// so a duplicate at or past first is a message this lane stored: its first answer was lost.
	first [3]uint64
	// takeover counts the messages still to look at after the lane's first new store: an
	// earlier owner may have stored messages past a refused one, at most a window (maxWindow)
	// past its acknowledged prefix, and everything before this lane's first new store is in
	// that prefix.
	takeover int
	started  bool
	// until is the last INCOMING sequence that was in flight when the lane last resent.
	until uint64
	// stored holds, for each device and stream, the stream sequences of the messages this lane
	// stored while looking, ascending, not yet found out of order. It is dropped when the lane
	// stops looking.
	stored map[reorderKey][]uint64
}

// streamOf is the index of e's output stream in reorders.first: OUTGOING, UNMAPPED, PARKED.
func streamOf(e *entry) int {
	switch {
	case e.reason != "":
		return 1
	case e.parked:
		return 2
	}
	return 0
}

// noteNew records that the stream acknowledged e as stored as new, at its sequence.
func (r *reorders) noteNew(e *entry) {
	if f := &r.first[streamOf(e)]; *f == 0 || e.om.Seq < *f {
		*f = e.om.Seq
	}
}

// noteStored notes every message in flight that its stream stored as new, before a duplicate is
// looked at: the answers came in any order, and a duplicate at or past the first new store is
// one of this lane's own (see reorders.first).
func (l *lane) noteStored() {
	for _, e := range l.q {
		if e.om.Stored && !e.om.Duplicate && e.om.Seq != 0 {
			l.ro.noteNew(e)
		}
	}
}

// observe looks at e, acknowledged, in INCOMING order: every message of e's device that this
// lane stored after e, although it comes before e, is a reorder, and is counted.
func (l *lane) observe(e *entry) {
	r := &l.ro
	if !r.started && !e.om.Duplicate && e.om.Seq != 0 {
		r.started = true
	}
	looking := r.takeover > 0 || e.seq <= r.until
	if r.started && r.takeover > 0 {
		r.takeover--
	}
	if !looking {
		r.stored = nil
		return
	}
	if e.device == "" || e.om.Seq == 0 {
		return // no device to keep in order (a malformed subject), or given up on (dropped)
	}
	k := reorderKey{device: e.device, stream: streamOf(e)}
	s := r.stored[k]
	i := len(s)
	for i > 0 && s[i-1] > e.om.Seq {
		i--
	}
	n := len(s) - i
	if n > 0 {
		l.p.reorders.Add(uint64(n))
		l.log.Error().Str("device", e.device).Uint64("seq", e.seq).Uint64("stored_at", e.om.Seq).Int("stored_after", n).
			Msg("messages of a device were stored after a later one of it: their order in the output stream is reversed (the server refused or lost single messages: its limits, or an output stream whose leader changed; kvmapper verify names them)")
		s = s[:i]
	}
	if f := r.first[streamOf(e)]; !e.om.Duplicate || (f != 0 && e.om.Seq >= f) {
		s = append(s, e.om.Seq)
	} else if n == 0 {
		return // nothing changed
	}
	if r.stored == nil {
		r.stored = make(map[reorderKey][]uint64)
	}
	r.stored[k] = s
}
