package wire

import "strings"

// Headers kvmapper sets on the messages it publishes.
const (
	HeaderReason    = "KVMapper-Reason"      // why a message went to UNMAPPED (see [Reasons])
	HeaderError     = "KVMapper-Error"       // the server's words, when a publish was refused
	HeaderSubject   = "KVMapper-Subject"     // on a dead letter: the subject the message was stored or arrived on
	HeaderPartition = "KVMapper-Partition"   // provenance until 2026-12-07: the partition the message came through (now in [HeaderProvenance])
	HeaderEpoch     = "KVMapper-Epoch"       // provenance until 2026-12-07: the owner's lease epoch (now in [HeaderProvenance])
	HeaderRevision  = "KVMapper-Revision"    // provenance until 2026-12-07: KV revision of the mapping used (now in [HeaderProvenance])
	HeaderOrigMsgID = "KVMapper-Orig-Msg-Id" // a Nats-Msg-Id the device set, kept under another name
	HeaderField     = "KVMapper-Field"       // on a dead letter of a bad value: the field of the device's value at fault
	// HeaderReplay names, on every message a replay publishes (unless provenance is off), the
	// replay that published it.
	HeaderReplay = "KVMapper-Replay"
)

// HeaderProbe marks the probes `kvmapper setup` publishes on device subjects: a message carrying
// it on a device whose id starts with [ProbeDevicePrefix] is a probe, and the replicas of direct
// mode drop it without forwarding it.
const (
	HeaderProbe       = "KVMapper-Probe"
	ProbeDevicePrefix = "kvmapper-probe-"
)

// ActsOnStream reports whether a header named name, on a message a device sent, would make the
// stream storing it do more than store that message: roll other messages up (Nats-Rollup), take
// the message into an atomic batch (Nats-Batch-Id, -Sequence, -Commit), schedule messages
// (Nats-Schedule…), or count (Nats-Incr). kvmapper passes none of them on to the streams it
// writes: they allow rollups, for the fence records, and a device's Nats-Rollup: all would wipe
// one. Names compare in any case.
func ActsOnStream(name string) bool {
	const nats = "Nats-"
	if len(name) < len(nats)+3 || !strings.EqualFold(name[:len(nats)], nats) {
		return false
	}
	rest := name[len(nats):]
	return strings.EqualFold(rest, "Rollup") || strings.EqualFold(rest, "Incr") ||
		len(rest) >= len("Batch-") && strings.EqualFold(rest[:len("Batch-")], "Batch-") ||
		len(rest) >= len("Schedule") && strings.EqualFold(rest[:len("Schedule")], "Schedule")
}
