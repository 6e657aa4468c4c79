// Package replay reprocesses a range of INCOMING through the mapping into a stream of the
// caller's choice, with the groups table as it is now or as it was at an earlier revision of the
// bucket. It reads each INCOMING stream with its own ordered consumer, without leases, so the
// running replicas are not disturbed; it publishes every message in stream order (each device's
// order is kept) with a Nats-Msg-Id derived from the replay's identity and the message's INCOMING
// stream, incarnation and sequence; and it records its progress in the control bucket
// (replay.<id>), so that a replay stopped or killed resumes where it was and stores nothing twice.
// Dialing NATS, parsing flags and drawing progress for people are left to the caller.
package replay
