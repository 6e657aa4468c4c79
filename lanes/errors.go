package lanes

import "errors"

var (
	// ErrInvalidConfig is wrapped by errors from [New] for a configuration it cannot run with.
	ErrInvalidConfig = errors.New("lanes: invalid config")
	// ErrFenced is returned by [Pool.Run] when another owner wrote the partition's checkpoint,
	// or the lease's own clock ran out: this replica must stop publishing for that partition.
	// A caller whose lease is lost cancels the lane's context with ErrFenced as its cause
	// (context.WithCancelCause): the lane then stops at once, resending nothing, and Run
	// returns nil. Any other cause (a release, a shutdown) lets the lane drain.
	ErrFenced = errors.New("lanes: partition fenced by a newer owner")
)

// Reasons a message is dead-lettered to UNMAPPED, carried in the [HeaderReason] header.
const (
	ReasonNoMapping        = "no-mapping"        // the device has no key in the groups bucket
	ReasonInvalidGroup     = "invalid-group"     // the device's value is not one valid subject token
	ReasonMalformedSubject = "malformed-subject" // the stored subject does not fit the in template
	ReasonOversized        = "oversized"         // OUTGOING (or the connection) refused the message's size
	ReasonRejected         = "rejected"          // OUTGOING refused the message for another permanent reason
	ReasonParkFull         = "park-full"         // PARKED refused it: its device, or the whole stream, at its limit
	ReasonParkExpired      = "park-expired"      // parked longer than the maximum age
	ReasonParkDropped      = "park-dropped"      // dropped from the park by hand (kvmapper unpark --drop)
	// ReasonDropped is never on a message: it marks one UNMAPPED refused even stripped.
	ReasonDropped = "dropped"
)

// Reasons are the reasons a message can carry in [HeaderReason], in the order above.
var Reasons = []string{ReasonNoMapping, ReasonInvalidGroup, ReasonMalformedSubject, ReasonOversized, ReasonRejected,
	ReasonParkFull, ReasonParkExpired, ReasonParkDropped}

// Headers kvmapper sets on the messages it publishes.
const (
	HeaderReason    = "KVMapper-Reason"      // why a message went to UNMAPPED
	HeaderError     = "KVMapper-Error"       // the server's words, when a publish was refused
	HeaderSubject   = "KVMapper-Subject"     // the stored INCOMING subject, on dead letters
	HeaderPartition = "KVMapper-Partition"   // provenance: the partition the message came through
	HeaderEpoch     = "KVMapper-Epoch"       // provenance: the owner's lease epoch
	HeaderRevision  = "KVMapper-Revision"    // provenance: KV revision of the mapping used
	HeaderOrigMsgID = "KVMapper-Orig-Msg-Id" // a Nats-Msg-Id the device set, kept under another name
)
