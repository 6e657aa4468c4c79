package wire

// Reasons a message is dead-lettered to UNMAPPED, carried in the [HeaderReason] header.
const (
	ReasonNoMapping        = "no-mapping"        // the device has no key in the groups bucket
	ReasonInvalidGroup     = "invalid-group"     // the device's value is not one valid subject token
	ReasonMalformedSubject = "malformed-subject" // the subject does not fit the in template
	ReasonOversized        = "oversized"         // OUTGOING (or the connection) refused the message's size
	ReasonRejected         = "rejected"          // OUTGOING refused the message for another permanent reason
	ReasonParkFull         = "park-full"         // PARKED refused it: its device, or the whole stream, at its limit
	ReasonParkExpired      = "park-expired"      // parked longer than the maximum age
	ReasonParkDropped      = "park-dropped"      // dropped from the park by hand (kvmapper unpark --drop)
	// ReasonDropped is never on a message: it marks, in the publishers that dead-letter, a
	// message UNMAPPED refused even stripped of its payload.
	ReasonDropped = "dropped"
)

// Reasons are the reasons a message can carry in [HeaderReason], in the order above.
var Reasons = []string{ReasonNoMapping, ReasonInvalidGroup, ReasonMalformedSubject, ReasonOversized, ReasonRejected,
	ReasonParkFull, ReasonParkExpired, ReasonParkDropped}
