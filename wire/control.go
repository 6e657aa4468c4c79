package wire

import (
	"strconv"
	"strings"
	"time"
)

// The kinds of key in the control bucket: lease.<p>, member.<id> and checkpoint.<p>, and
// unpark.<p>.<device> ([UnparkKey]) and replay.<id> ([ReplayKey]), which [ParseControlKey]
// leaves to the lanes and to replay.
const (
	KindLease      = "lease"
	KindMember     = "member"
	KindCheckpoint = "checkpoint"
	KindUnpark     = "unpark"
	KindReplay     = "replay"
)

// LeaseKey is the control-bucket key of partition p's lease; its value is the owner's id.
func LeaseKey(p int) string { return KindLease + "." + strconv.Itoa(p) }

// LeaseFilter is the key filter of every partition's lease, "lease.>".
const LeaseFilter = KindLease + ".>"

// MemberKey is the control-bucket key a live replica heartbeats; its value is [MemberValue].
func MemberKey(id string) string { return KindMember + "." + id }

// MemberValue is the value of a replica's member key: its id and, after a newline, when the
// last of its own writes to the control bucket that it saw back on its watch was stored (Unix
// nanoseconds, by the bucket's timestamps), if it has seen one. The second line tells the other
// replicas whether it hears the bucket: a replica whose connection delivers its writes but not
// the bucket's answers (after a network cut heals, one direction of a TCP connection can
// recover seconds before the other) heartbeats without hearing anything, and cannot take
// partitions handed to it. Older replicas wrote the bare id.
func MemberValue(id string, heard time.Time) []byte {
	if heard.IsZero() {
		return []byte(id)
	}
	return strconv.AppendInt(append([]byte(id), '\n'), heard.UnixNano(), 10)
}

// ParseMemberValue returns the id and the time of [MemberValue]; heard is zero when the value
// names none (a bare id, or a replica that has not seen its own writes yet).
func ParseMemberValue(v []byte) (id string, heard time.Time) {
	s := string(v)
	id, ns, ok := strings.Cut(s, "\n")
	if !ok {
		return s, time.Time{}
	}
	n, err := strconv.ParseInt(ns, 10, 64)
	if err != nil || n <= 0 {
		return id, time.Time{}
	}
	return id, time.Unix(0, n)
}

// MemberFilter is the key filter of every member, "member.>" (a member id may hold dots).
const MemberFilter = KindMember + ".>"

// CheckpointKey is the control-bucket key of partition p's checkpoint: the last INCOMING
// sequence of p whose republish was acknowledged, with the incarnation of INCOMING it belongs to
// ([Checkpoint]).
func CheckpointKey(p int) string { return KindCheckpoint + "." + strconv.Itoa(p) }

// ParkedKey is the control-bucket key that says a deployment parks devices: setup writes it,
// with the PARKED stream's name, when it creates or verifies that stream. Replicas and status look
// at PARKED only when it exists, so that a deployment that never parked needs no permission on
// PARKED.
const ParkedKey = "parked"

// LayoutKey is the control-bucket key that records a deployment's stream layout
// (subjects.StreamLayout): setup writes it ("single" or "streams") once it has created or
// verified INCOMING, and every command whose layout is subjects.AutoLayout reads it, so that one
// deployment is never split across layouts.
const LayoutKey = "layout"

// ModeKey is the control-bucket key that says a deployment runs in direct mode, where devices
// publish to no stream and the owner of each partition republishes what it receives to
// OUTGOING: setup writes [ModeDirect] in it when it runs in direct mode (as every replica of
// that mode does when it starts), and deletes it when it runs in stream mode. No key means
// stream mode. status and verify read it: in direct mode there is no INCOMING to read.
const ModeKey = "mode"

// MarksDirect reports whether v, the value of [ModeKey], marks direct mode.
func MarksDirect(v []byte) bool { return string(v) == string(ModeDirect) }

// UnparkKey is the control-bucket key that asks the owner of partition p to unpark device (its
// value, an [UnparkAction], says how); the owner deletes it once done.
func UnparkKey(p int, device string) string {
	return KindUnpark + "." + strconv.Itoa(p) + "." + device
}

// UnparkFilter is the key filter of partition p's unpark keys, "unpark.<p>.*".
func UnparkFilter(p int) string { return KindUnpark + "." + strconv.Itoa(p) + ".*" }

// UnparkAction is the value of an unpark key ([UnparkKey]): what its partition's owner does with
// the device's parked messages.
type UnparkAction string

const (
	// UnparkRelease republishes each parked message with the device's group, or dead-letters it
	// with the reason its lookup gives.
	UnparkRelease UnparkAction = "release"
	// UnparkDrop dead-letters each parked message as [ReasonParkDropped].
	UnparkDrop UnparkAction = "drop"
)

// ParseUnparkAction reads the value of an unpark key, white space around it ignored: "drop" is
// [UnparkDrop], anything else [UnparkRelease] (the owner of a partition releases what it cannot
// read rather than drop it).
func ParseUnparkAction(v []byte) UnparkAction {
	if UnparkAction(strings.TrimSpace(string(v))) == UnparkDrop {
		return UnparkDrop
	}
	return UnparkRelease
}

// ReplayKey is the control-bucket key of the progress record of replay id (JSON, written and read
// by package replay only): "replay.<id>".
func ReplayKey(id string) string { return KindReplay + "." + id }

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
