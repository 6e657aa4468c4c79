package subjects

import (
	"cmp"
	"strconv"
	"strings"
)

// Names are the streams and buckets one kvmapper deployment uses. Zero fields mean the defaults
// ([DefaultNames]); every one of them is a flag of every command.
type Names struct {
	Incoming string // the stream devices publish into
	Outgoing string // the stream mapped messages go to
	Unmapped string // the stream dead letters go to
	Groups   string // the KV bucket of device id → group id
	Control  string // the KV bucket of leases, members and checkpoints
}

// DefaultNames are the names kvmapper uses unless told otherwise.
var DefaultNames = Names{Incoming: "INCOMING", Outgoing: "OUTGOING", Unmapped: "UNMAPPED", Groups: "device-groups", Control: "kvmapper"}

// WithDefaults returns n with each empty name set to its default.
func (n Names) WithDefaults() Names {
	d := DefaultNames
	return Names{
		Incoming: cmp.Or(n.Incoming, d.Incoming),
		Outgoing: cmp.Or(n.Outgoing, d.Outgoing),
		Unmapped: cmp.Or(n.Unmapped, d.Unmapped),
		Groups:   cmp.Or(n.Groups, d.Groups),
		Control:  cmp.Or(n.Control, d.Control),
	}
}

// BucketStream is the name of the stream behind KV bucket b, as the server names it.
func BucketStream(b string) string { return "KV_" + b }

// The kinds of key in the control bucket: lease.<p>, member.<id> and checkpoint.<p>.
const (
	KindLease      = "lease"
	KindMember     = "member"
	KindCheckpoint = "checkpoint"
)

// LeaseKey is the control-bucket key of partition p's lease; its value is the owner's id.
func LeaseKey(p int) string { return KindLease + "." + strconv.Itoa(p) }

// MemberKey is the control-bucket key a live replica heartbeats; its value is the replica's id.
func MemberKey(id string) string { return KindMember + "." + id }

// CheckpointKey is the control-bucket key of partition p's checkpoint: the last INCOMING
// sequence of p whose republish was acknowledged, with the incarnation of INCOMING it belongs to.
func CheckpointKey(p int) string { return KindCheckpoint + "." + strconv.Itoa(p) }

// ParseControlKey splits a control-bucket key into its kind ([KindLease], [KindMember] or
// [KindCheckpoint]) and the rest: the partition of a lease or checkpoint (p is -1 for a member,
// or for a partition that is not a number), the id of a member. ok is false for any other key.
func ParseControlKey(key string) (kind string, p int, id string, ok bool) {
	kind, rest, found := strings.Cut(key, ".")
	if !found || rest == "" {
		return "", -1, "", false
	}
	switch kind {
	case KindMember:
		return kind, -1, rest, true
	case KindLease, KindCheckpoint:
		n, err := strconv.Atoi(rest)
		if err != nil || n < 0 || strconv.Itoa(n) != rest {
			return "", -1, "", false
		}
		return kind, n, "", true
	}
	return "", -1, "", false
}
