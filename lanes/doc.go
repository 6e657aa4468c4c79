// Package lanes runs one ordered pipeline per owned partition of INCOMING (one stream filtered by
// partition, or one stream per partition): consume with an ordered consumer from the stored
// checkpoint, map each message's device to its group, publish asynchronously with a
// deterministic Nats-Msg-Id into OUTGOING (or UNMAPPED with a reason), and checkpoint the
// contiguous acknowledged prefix in the control bucket. It keeps each device's order across
// publish failures and reconnects, and bounds the publishes in flight per replica. It leaves
// leases to package election: a lane runs under the context and fence it is handed, and stops
// when either says so.
package lanes
