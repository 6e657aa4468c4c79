package wire

import (
	"encoding/json"
	"fmt"
	"strings"
)

// FenceKey is the control-bucket key that says every output stream of a deployment carries its
// fence subjects (subjects.FenceSubject) and takes atomic batches: setup writes it, with the
// streams' names, once it has created or verified them so. Replicas take a silent owner's
// partitions over after a judged expiry only while it is there (docs/design-fencing.md).
const FenceKey = "fence"

// FenceRecord is the message a partition's new owner writes on the partition's fence subject in
// each output stream before its first write there. Every later write of an owner checks, with
// Nats-Expected-Last-Subject-Sequence, that the fence subject's last message is its own record:
// the stream itself then refuses the writes of an owner whose successor wrote its record.
type FenceRecord struct {
	Partition int    `json:"partition"`
	Epoch     uint64 `json:"epoch"` // the lease's epoch: the KV revision of its claim
	Owner     string `json:"owner"` // the replica id
	// Control is the incarnation of the control bucket (its creation time, as [Incarnation]
	// writes it) whose revisions Epoch counts: a re-created bucket counts from 1 again.
	Control string `json:"control"`
	// Nonce tells this record from any other, so that a writer whose answer was lost can
	// recognise its own record when it reads the subject back.
	Nonce string `json:"nonce"`
}

// Append appends r as JSON to b.
func (r FenceRecord) Append(b []byte) []byte {
	out, _ := json.Marshal(r) // a struct of strings and numbers cannot fail
	return append(b, out...)
}

// ParseFenceRecord reads a fence record; the error wraps [ErrInvalid].
func ParseFenceRecord(v []byte) (FenceRecord, error) {
	var r FenceRecord
	if err := json.Unmarshal(v, &r); err != nil {
		return FenceRecord{}, fmt.Errorf("%w: fence record %q: %w", ErrInvalid, v, err)
	}
	return r, nil
}

// Supersedes reports whether r was written by a later owner than o: a later control bucket
// incarnation, or the same and a larger epoch. Incarnations are base-36 times: a longer one is
// later, and among equally long ones they compare as strings.
func (r FenceRecord) Supersedes(o FenceRecord) bool {
	if r.Control != o.Control {
		return len(r.Control) > len(o.Control) || len(r.Control) == len(o.Control) && r.Control > o.Control
	}
	return r.Epoch > o.Epoch
}

// checkedVersion starts every [FormatChecked] value: the protocol its writes keep.
const checkedVersion = "v1 "

// FormatChecked is what a partition's owner advertises on its lease (election's
// Kvmapper-Lease-Checked header) while its lane writes every output stream it writes (streams)
// fence-checked, under a fence record it wrote in each: "v1 OUTGOING,UNMAPPED". Only such an owner
// may be judged dead before its lease expires: its successor's records refuse whatever it still
// writes. Version 1 is this protocol: atomic batches or singles carrying
// Nats-Expected-Last-Subject-Sequence on the partition's fence subject in each stream, never a
// fast-ingest batch.
func FormatChecked(streams []string) string {
	return checkedVersion + strings.Join(streams, ",")
}

// ParseChecked reads a [FormatChecked] value: the streams, and false for anything else (no
// advertisement, or another version's, which this build cannot vouch for).
func ParseChecked(v string) ([]string, bool) {
	rest, ok := strings.CutPrefix(v, checkedVersion)
	if !ok || rest == "" {
		return nil, false
	}
	return strings.Split(rest, ","), true
}

// ParseFences reads the value of [FenceKey]: the names of the fenced output streams.
func ParseFences(v []byte) []string {
	if len(v) == 0 {
		return nil
	}
	return strings.Split(string(v), ",")
}
