package wire

// Reasons a message is dead-lettered to UNMAPPED, carried in the [HeaderReason] header.
const (
	ReasonNoMapping        = "no-mapping"        // the device has no key in the groups bucket
	ReasonInvalidGroup     = "invalid-group"     // the device's plain value is not one valid subject token where {group} is used
	ReasonInvalidValue     = "invalid-value"     // the device's value starts with '{' but is not one JSON object, or names a field twice
	ReasonMissingField     = "missing-field"     // the device's value lacks a field the templates use ([HeaderField] names it)
	ReasonInvalidField     = "invalid-field"     // a field of the device's value cannot be used where the templates use it ([HeaderField] names it)
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
var Reasons = []string{ReasonNoMapping, ReasonInvalidGroup, ReasonInvalidValue, ReasonMissingField, ReasonInvalidField, ReasonMalformedSubject, ReasonOversized, ReasonRejected,
	ReasonParkFull, ReasonParkExpired, ReasonParkDropped}

// ValueReasons are the reasons of a device whose value the templates cannot use: a device the
// groups table holds, but cannot map. Under --on-unmapped park all but [ReasonInvalidGroup] (a
// plain value, dead-lettered as before values could be JSON) park the device instead.
var ValueReasons = []string{ReasonInvalidGroup, ReasonInvalidValue, ReasonMissingField, ReasonInvalidField}
