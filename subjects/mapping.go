package subjects

import "strings"

// Mapping is what a mapper learns of one device from its groups table: the values its templates
// render the device's messages with, or why it cannot map them. It is small on purpose (it is
// returned once per message): the reason, the field at fault and the detail are one string.
type Mapping struct {
	// Values are the fields of the device's value the templates use, decoded by the layout's
	// [Schema]; empty when the device cannot be mapped.
	Values Values
	// Revision is the KV revision of the device's value; 0 when it has none.
	Revision uint64
	fault    string // "" when mapped, else [AppendFault]'s form
}

// Unmappable returns the Mapping of a device that cannot be mapped: reason is the dead-letter
// reason (no mapping, a value the templates cannot use), field the field of the value at fault
// (or ""), detail what is wrong, for people (or "").
func Unmappable(reason, field, detail string, rev uint64) Mapping {
	if field == "" && detail == "" {
		return Mapping{Revision: rev, fault: reason}
	}
	return Mapping{Revision: rev, fault: string(AppendFault(nil, reason, field, detail))}
}

// AppendFault appends the form of a device's fault to dst: reason, field and detail joined by
// NUL bytes, which none of them holds. [Faulted] reads it back without copying.
func AppendFault(dst []byte, reason, field, detail string) []byte {
	dst = append(append(dst, reason...), 0)
	dst = append(append(dst, field...), 0)
	return append(dst, detail...)
}

// Faulted returns the Mapping of a device whose fault, in [AppendFault]'s form, is fault.
func Faulted(fault string, rev uint64) Mapping { return Mapping{Revision: rev, fault: fault} }

// Mapped reports whether the device can be mapped.
func (m Mapping) Mapped() bool { return m.fault == "" }

// Reason returns the dead-letter reason, "" when the device can be mapped.
func (m Mapping) Reason() string {
	r, _, _ := strings.Cut(m.fault, "\x00")
	return r
}

// Field returns the field of the value at fault, if any.
func (m Mapping) Field() string {
	_, rest, _ := strings.Cut(m.fault, "\x00")
	f, _, _ := strings.Cut(rest, "\x00")
	return f
}

// Detail says what is wrong with the value, for people; "" for a device without a value.
func (m Mapping) Detail() string {
	_, rest, _ := strings.Cut(m.fault, "\x00")
	_, d, _ := strings.Cut(rest, "\x00")
	return d
}
