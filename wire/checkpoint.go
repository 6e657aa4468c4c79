package wire

import (
	"bytes"
	"fmt"
	"strconv"
)

// Checkpoint is the value of checkpoint.<p> ([CheckpointKey]): the last INCOMING sequence of the
// partition whose republish was acknowledged, in one incarnation of INCOMING ([Incarnation]). It
// is stored as "<incarnation>:<sequence>"; a value written by kvmapper before incarnations
// ("<sequence>") reads with Incarnation "".
type Checkpoint struct {
	Incarnation string
	Seq         uint64
}

// ParseCheckpoint reads a checkpoint value. It fails wrapping [ErrInvalid] for a value of
// another form.
func ParseCheckpoint(v []byte) (Checkpoint, error) {
	inc, seq, found := bytes.Cut(v, []byte(":"))
	if !found {
		inc, seq = nil, v
	}
	n, err := strconv.ParseUint(string(seq), 10, 64)
	if err != nil || (found && len(inc) == 0) {
		return Checkpoint{}, fmt.Errorf("%w: checkpoint %q is not <incarnation>:<sequence>", ErrInvalid, v)
	}
	return Checkpoint{Incarnation: string(inc), Seq: n}, nil
}

// Append appends the stored form of c to b.
func (c Checkpoint) Append(b []byte) []byte {
	if c.Incarnation != "" {
		b = append(append(b, c.Incarnation...), ':')
	}
	return strconv.AppendUint(b, c.Seq, 10)
}

// String returns the stored form of c.
func (c Checkpoint) String() string { return string(c.Append(nil)) }
