package lanes

import (
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/wire"
)

// refused handles a publish refused for good. A message for OUTGOING becomes a dead letter; a
// dead letter refused in turn is resent stripped to its reason, error, subject and id headers
// and no payload; if even that is refused, the lane gives up on it — counted as dropped and
// logged as an error — rather than block the partition. It returns false when it gave up.
// Whatever is dropped stays in INCOMING under the sequence the log names.
func (l *lane) refused(e *entry, reason, why string) bool {
	switch {
	case e.reason == "":
		l.p.warn("refused", func(ev *zerolog.Event) {
			ev.Int("partition", l.a.Partition).Uint64("seq", e.seq).Str("reason", reason).Str("error", why).
				Msg("OUTGOING (or PARKED, for a park) refused a message for good; dead-lettered to UNMAPPED")
		})
		l.redirect(e, reason, why)
	case !e.stripped:
		l.p.warn("refused-dead", func(ev *zerolog.Event) {
			ev.Int("partition", l.a.Partition).Uint64("seq", e.seq).Str("error", why).
				Msg("UNMAPPED refused a dead letter; resending it without payload and original headers")
		})
		l.strip(e, why)
	default:
		l.p.dropped.Add(1)
		l.log.Error().Uint64("seq", e.seq).Str("error", why).
			Msg("UNMAPPED refused even a stripped dead letter; giving up on it (it stays in INCOMING at this sequence): check UNMAPPED's limits")
		e.reason = wire.ReasonDropped
		return false // the writer settles it as dropped
	}
	return true
}

// strip reduces a dead letter to what says why it is one: no payload, no original headers.
func (l *lane) strip(e *entry, why string) {
	old := e.msg().Header
	hdr := nats.Header{
		nats.MsgIdHdr:      old[nats.MsgIdHdr],
		wire.HeaderReason:  old[wire.HeaderReason],
		wire.HeaderSubject: []string{e.src.Subject()},
	}
	if v := old.Get(wire.HeaderError); v != "" {
		why = v + "; then: " + why
	}
	hdr[wire.HeaderError] = []string{why}
	e.om.Out = &nats.Msg{Subject: e.msg().Subject, Header: hdr}
	e.stripped = true
}
