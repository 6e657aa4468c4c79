package kv

import (
	"cmp"
	"errors"
	"strings"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// A record is what the table holds of one value: the packed subjects.Values the templates render,
// or, for a value they cannot use, why (see appendInvalid). Records are interned in
// Table.records, counted by the slots that hold them.

// entry unpacks a record.
func (t *Table) entry(rec string, invalid bool, rev uint64) Entry {
	if invalid {
		return invalidEntry(rec, rev)
	}
	e := Entry{Values: subjects.ValuesOf(rec), Revision: rev}
	if t.group >= 0 {
		e.Group = e.Values.Get(t.group)
	}
	return e
}

// An invalid record is "\xff" + reason + "\x00" + field + "\x00" + detail: its first byte
// tells it from a packed subjects.Values, whose first byte counts at most subjects.MaxFields.
const invalidMark = 0xff

func appendInvalid(dst []byte, reason, field, detail string) []byte {
	return subjects.AppendFault(append(dst, invalidMark), reason, field, detail)
}

func invalidEntry(rec string, rev uint64) Entry {
	reason, rest, _ := strings.Cut(rec[1:], "\x00")
	field, detail, _ := strings.Cut(rest, "\x00")
	return Entry{Revision: rev, Invalid: true, Reason: reason, Field: field, Detail: detail}
}

// appendRecord decodes value with schema and appends its record to dst: the packed Values, or
// an invalid record that says why.
func appendRecord(dst []byte, schema *subjects.Schema, value []byte) (rec []byte, invalid bool) {
	b, err := schema.Append(dst, value)
	if err == nil {
		return b, false
	}
	var ve *subjects.ValueError
	if !errors.As(err, &ve) {
		ve = &subjects.ValueError{Err: subjects.ErrInvalidValue, Detail: err.Error()}
	}
	return appendInvalid(dst, reasonOf(ve), ve.Field, ve.Detail), true
}

// reasonOf is the dead-letter reason of a value error.
func reasonOf(ve *subjects.ValueError) string {
	switch {
	case errors.Is(ve, subjects.ErrMissingField):
		return wire.ReasonMissingField
	case errors.Is(ve, subjects.ErrInvalidField):
		return wire.ReasonInvalidField
	case errors.Is(ve, subjects.ErrInvalidToken):
		return wire.ReasonInvalidGroup
	}
	return wire.ReasonInvalidValue
}

// DecodeEntry decodes value, a device's value written at revision rev, with schema (nil:
// subjects.GroupSchema), as a [Table] does: trailing line breaks dropped, then the Values the
// templates render, or why they cannot. The entry shares no memory with value.
func DecodeEntry(schema *subjects.Schema, value []byte, rev uint64) Entry {
	schema = cmp.Or(schema, subjects.GroupSchema)
	rec, invalid := appendRecord(nil, schema, trimNewlines(value))
	if invalid {
		return invalidEntry(string(rec), rev)
	}
	e := Entry{Values: subjects.ValuesOf(string(rec)), Revision: rev}
	if g := schema.Group(); g >= 0 {
		e.Group = e.Values.Get(g)
	}
	return e
}

// Invalid returns the number of devices whose value the templates cannot use, by reason (the
// reasons of wire.ValueReasons that have any). Safe for concurrent use.
func (t *Table) Invalid() map[string]int {
	out := map[string]int{}
	for i, r := range wire.ValueReasons {
		if n := t.invalid[i].Load(); n > 0 {
			out[r] = int(n)
		}
	}
	return out
}

// record returns the index of value's record, interned, with one more reference to it, and the
// entry it makes. Only the writer calls it.
func (t *Table) record(value []byte, rev uint64) (uint32, Entry) {
	b, invalid := appendRecord(t.scratch[:0], t.schema, value)
	t.scratch = b[:0]
	i, ok := t.intern[string(b)]
	if !ok {
		rec := string(b)
		records := *t.records.Load()
		if n := len(t.free); n > 0 {
			i, t.free = t.free[n-1], t.free[:n-1]
			records[i] = rec // no slot refers to i, so no reader reads it
			t.refs[i] = 0
		} else {
			i = uint32(len(records))
			records = append(records, rec)
			t.refs = append(t.refs, 0)
			t.records.Store(&records)
		}
		t.intern[rec] = i
	}
	t.refs[i]++
	rec := (*t.records.Load())[i]
	if invalid {
		e := invalidEntry(rec, rev)
		t.invalid[reasonIndex(e.Reason)].Add(1)
		return i | invalidRec, e
	}
	return i, t.entry(rec, false, rev)
}

// release drops one reference to record r, which a slot no longer holds, and frees its index
// when it was the last. Only the writer calls it, after the slot's shard lock was released.
func (t *Table) release(r uint32) {
	i := r &^ invalidRec
	records := *t.records.Load()
	if r&invalidRec != 0 {
		t.invalid[reasonIndex(invalidEntry(records[i], 0).Reason)].Add(-1)
	}
	if t.refs[i]--; t.refs[i] == 0 {
		delete(t.intern, records[i])
		records[i] = ""
		t.free = append(t.free, i)
	}
}

func reasonIndex(reason string) int {
	for i, r := range wire.ValueReasons {
		if r == reason {
			return i
		}
	}
	return len(wire.ValueReasons) - 1
}

// Mapping returns e as the lanes and direct mode take it: its values and revision, or the
// reason, field and detail of an unusable value.
func (e Entry) Mapping() subjects.Mapping {
	if e.Invalid {
		return subjects.Unmappable(e.Reason, e.Field, e.Detail, e.Revision)
	}
	return subjects.Mapping{Values: e.Values, Revision: e.Revision}
}

var noMapping = subjects.Unmappable(wire.ReasonNoMapping, "", "", 0)
