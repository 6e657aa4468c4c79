package wire

// Headers kvmapper sets on the messages it publishes.
const (
	HeaderReason    = "KVMapper-Reason"      // why a message went to UNMAPPED (see [Reasons])
	HeaderError     = "KVMapper-Error"       // the server's words, when a publish was refused
	HeaderSubject   = "KVMapper-Subject"     // on a dead letter: the subject the message was stored or arrived on
	HeaderPartition = "KVMapper-Partition"   // provenance: the partition the message came through
	HeaderEpoch     = "KVMapper-Epoch"       // provenance: the owner's lease epoch
	HeaderRevision  = "KVMapper-Revision"    // provenance: KV revision of the mapping used
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
