package replay

import (
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/wire"
)

const expectedPrefix = "Nats-Expected-"

// build makes e what to publish for the message it holds: the mapped message, or a dead letter
// with its reason, under the same rules as the live mapper's (package lanes: headers copied but
// for Nats-Expected-*, a device's own Nats-Msg-Id kept as KVMapper-Orig-Msg-Id, the same reasons).
// It returns false when the message is not one the replay was asked for (another device or
// partition).
func (r *Replay) build(e *entry, src source) bool {
	lay := r.cfg.Layout
	m := e.src
	if err := lay.Parse(m.Subject(), &r.fields); err != nil {
		if r.devices != nil {
			return false // it belongs to no device
		}
		hdr := r.headers(e, src)
		hdr[wire.HeaderSubject] = []string{m.Subject()}
		e.reason = wire.ReasonMalformedSubject
		e.msg = &nats.Msg{Subject: lay.MalformedSubject(), Header: hdr, Data: m.Data()}
		r.deadHeaders(hdr, e.reason, err.Error(), -1)
		e.target = r.tg.dead
		return true
	}
	p, device := r.fields.Partition(), r.fields.Device()
	if !r.parts[p] || (r.devices != nil && !r.devices[device]) {
		return false
	}
	hdr := r.headers(e, src)
	e.msg = &nats.Msg{Header: hdr, Data: m.Data()}
	reason := ""
	ent, ok := r.snap.Lookup(device)
	switch {
	case r.snap.Unknown(device):
		reason = ReasonHistoryMissing
	case !ok:
		reason = wire.ReasonNoMapping
	case ent.Invalid:
		reason = ent.Reason
	}
	if reason != "" {
		e.reason = reason
		r.buf = lay.AppendUnmapped(r.buf[:0], &r.fields)
		e.msg.Subject = string(r.buf)
		r.deadHeaders(hdr, reason, ent.Detail, p)
		if ent.Field != "" {
			hdr[wire.HeaderField] = []string{ent.Field}
		}
		e.target = r.tg.dead
		return true
	}
	e.group = ent.Group
	r.buf = lay.AppendOut(r.buf[:0], &r.fields, ent.Values)
	e.msg.Subject = string(r.buf)
	for i := range lay.NumHeaders() {
		hdr[lay.HeaderName(i)] = []string{string(lay.AppendHeader(r.buf[:0], i, &r.fields, ent.Values))}
	}
	e.target = r.tg.into
	if !r.cfg.NoProvenance {
		hdr[wire.HeaderProvenance] = []string{wire.ProvenanceValue(p, 0, ent.Revision)}
		hdr[wire.HeaderReplay] = []string{r.id}
	}
	return true
}

// headers returns the message's headers made fit for the target: the Nats-Expected-* headers
// addressed INCOMING and are dropped, a device's own Nats-Msg-Id is kept under
// KVMapper-Orig-Msg-Id, Nats-Msg-Id becomes the replay's id for the message, and a header named
// as one of the output headers, in any case, is dropped: the mapping sets it.
func (r *Replay) headers(e *entry, src source) nats.Header {
	hdr := e.src.Headers()
	if hdr == nil {
		hdr = make(nats.Header, 4)
	}
	for k := range hdr {
		if len(k) >= len(expectedPrefix) && strings.EqualFold(k[:len(expectedPrefix)], expectedPrefix) || r.cfg.Layout.IsHeader(k) || wire.ActsOnStream(k) || wire.IsProvenance(k) {
			delete(hdr, k)
		}
	}
	if id, ok := hdr[nats.MsgIdHdr]; ok {
		hdr[wire.HeaderOrigMsgID] = id
	}
	hdr[nats.MsgIdHdr] = []string{r.idPrefix(src) + strconv.FormatUint(e.seq, 10)}
	return hdr
}

// deadHeaders adds a dead letter's reason, error and provenance; p is -1 when the subject named
// no partition.
func (r *Replay) deadHeaders(hdr nats.Header, reason, why string, p int) {
	hdr[wire.HeaderReason] = []string{reason}
	if why != "" {
		hdr[wire.HeaderError] = []string{why}
	}
	if !r.cfg.NoProvenance {
		if p >= 0 {
			hdr[wire.HeaderProvenance] = []string{wire.ProvenanceValue(p, 0, 0)}
		}
		hdr[wire.HeaderReplay] = []string{r.id}
	}
}

// redirect turns e into a dead letter after its target refused it for good.
func (r *Replay) redirect(e *entry, reason, why string) {
	lay := r.cfg.Layout
	hdr := e.msg.Header
	delete(hdr, wire.HeaderProvenance)
	subject, p := lay.MalformedSubject(), -1
	if err := lay.Parse(e.src.Subject(), &r.fields); err == nil {
		subject, p = string(lay.AppendUnmapped(r.buf[:0], &r.fields)), r.fields.Partition()
	}
	hdr[wire.HeaderSubject] = []string{e.src.Subject()}
	r.deadHeaders(hdr, reason, why, p)
	e.reason, e.group = reason, ""
	data := e.msg.Data
	if reason == wire.ReasonOversized {
		data = nil // the payload is what did not fit; it stays in INCOMING
	}
	e.msg = &nats.Msg{Subject: subject, Header: hdr, Data: data}
	r.retarget(e, r.tg.dead)
}

// strip reduces a dead letter to what says why it is one: no payload, no original headers.
func (r *Replay) strip(e *entry, why string) {
	old := e.msg.Header
	if v := old.Get(wire.HeaderError); v != "" {
		why = v + "; then: " + why
	}
	hdr := nats.Header{
		nats.MsgIdHdr:      old[nats.MsgIdHdr],
		wire.HeaderReason:  old[wire.HeaderReason],
		wire.HeaderSubject: []string{e.src.Subject()},
		wire.HeaderError:   []string{why},
	}
	e.msg = &nats.Msg{Subject: e.msg.Subject, Header: hdr}
	e.stripped = true
}

// retarget points e at another stream: its floor is that stream's.
func (r *Replay) retarget(e *entry, target string) {
	if e.target != target {
		e.target, e.sent = target, false
	}
}
