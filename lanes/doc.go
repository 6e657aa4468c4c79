// Package lanes runs one ordered pipeline per owned partition of INCOMING (one stream filtered by
// partition, or one stream per partition): consume with an ordered consumer from the stored
// checkpoint, map each message's device to its group, write it with a deterministic Nats-Msg-Id
// into OUTGOING (or UNMAPPED with a reason) through package ordered, and checkpoint the
// contiguous stored prefix in the control bucket. It keeps each device's order across publish
// failures, leader changes and reconnects, and bounds the publishes in flight per replica.
//
// Parking (park*.go, unpark_request.go) lives here too, beside the lane it serves: a device's
// parked messages hold back its later ones in the lane's own order, and a release drains them
// through the same kind of ordered.Writer the lane writes with. How a message is published,
// resent and settled is package ordered's; leases are package election's: a lane runs under the
// context and fence it is handed, and stops when either says so.
package lanes
