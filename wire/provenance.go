package wire

import (
	"strconv"
	"strings"
)

// HeaderProvenance carries a message's provenance in one header (issue 33): the partition it came
// through, the owner's lease epoch and the KV revision of the mapping used, as
// "<partition>.<epoch>.<revision>" in decimal. A field that does not apply is left empty and
// trailing empty fields are left out: a dead letter has no revision ("3.17"), a replayed message
// no epoch ("3..10007", a replay holds no lease), a replayed dead letter only its partition ("3").
//
// It replaces [HeaderPartition], [HeaderEpoch] and [HeaderRevision], which kvmapper wrote until
// 2026-12-07 and which [ReadProvenance] still reads on messages stored before: one header is one
// name to scan and about 40 bytes less per message than three, on every copy of a replicated
// stream, and nats-server scans a message's whole header block once for every special header it
// looks for.
const HeaderProvenance = "KVMapper-Prov"

// Provenance is what a message's provenance headers say; a zero field was not given.
type Provenance struct {
	Partition    int
	HasPartition bool
	Epoch        uint64 // 0: none (lease epochs start at 1)
	Revision     uint64 // 0: none (KV revisions start at 1)
}

// AppendProvenance appends the value of [HeaderProvenance] to dst: partition, then epoch and
// revision where not 0, trailing empty fields left out.
func AppendProvenance(dst []byte, partition int, epoch, revision uint64) []byte {
	dst = strconv.AppendInt(dst, int64(partition), 10)
	if epoch == 0 && revision == 0 {
		return dst
	}
	dst = append(dst, '.')
	if epoch != 0 {
		dst = strconv.AppendUint(dst, epoch, 10)
	}
	if revision != 0 {
		dst = strconv.AppendUint(append(dst, '.'), revision, 10)
	}
	return dst
}

// ProvenanceValue is [AppendProvenance] as a string.
func ProvenanceValue(partition int, epoch, revision uint64) string {
	return string(AppendProvenance(nil, partition, epoch, revision))
}

// ParseProvenance parses a value of [HeaderProvenance]; false when it is not one.
func ParseProvenance(v string) (Provenance, bool) {
	ps, rest, _ := strings.Cut(v, ".")
	es, rs, _ := strings.Cut(rest, ".")
	var pv Provenance
	p, err := strconv.ParseUint(ps, 10, 31)
	if err != nil {
		return Provenance{}, false
	}
	pv.Partition, pv.HasPartition = int(p), true
	if es != "" {
		if pv.Epoch, err = strconv.ParseUint(es, 10, 64); err != nil {
			return Provenance{}, false
		}
	}
	if rs != "" {
		if pv.Revision, err = strconv.ParseUint(rs, 10, 64); err != nil {
			return Provenance{}, false
		}
	}
	return pv, true
}

// IsProvenance reports whether name is one of kvmapper's provenance headers, current or legacy,
// in any case: a device's message carrying one has it left out, so that no device can pass
// provenance off.
func IsProvenance(name string) bool {
	return len(name) >= len("KVMapper-") && strings.EqualFold(name[:len("KVMapper-")], "KVMapper-") &&
		(strings.EqualFold(name, HeaderProvenance) || strings.EqualFold(name, HeaderPartition) ||
			strings.EqualFold(name, HeaderEpoch) || strings.EqualFold(name, HeaderRevision))
}

// ReadProvenance returns the provenance a message's headers carry, given get (nats.Header.Get):
// [HeaderProvenance] when the message has it (false when that is not a value [ParseProvenance]
// reads), else the three headers kvmapper wrote before it ([HeaderPartition], [HeaderEpoch],
// [HeaderRevision]), each on its own, a field it cannot read left zero; false when the message
// has no provenance at all.
func ReadProvenance(get func(string) string) (Provenance, bool) {
	if v := get(HeaderProvenance); v != "" {
		return ParseProvenance(v)
	}
	// Each value is looked at before it is parsed: a failed parse allocates its error, and a
	// message without provenance (--no-provenance) would cost an audit three of them.
	var pv Provenance
	if v := get(HeaderPartition); v != "" {
		if p, err := strconv.ParseUint(v, 10, 31); err == nil {
			pv.Partition, pv.HasPartition = int(p), true
		}
	}
	if v := get(HeaderEpoch); v != "" {
		pv.Epoch, _ = strconv.ParseUint(v, 10, 64)
	}
	if v := get(HeaderRevision); v != "" {
		pv.Revision, _ = strconv.ParseUint(v, 10, 64)
	}
	return pv, pv.HasPartition || pv.Epoch != 0 || pv.Revision != 0
}
