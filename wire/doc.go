// Package wire is kvmapper's vocabulary: every name and format it writes where another process
// reads it, defined once. Headers on the messages it publishes, the reasons of dead letters,
// Nats-Msg-Ids and the incarnations of streams they name, checkpoint values, the keys of the
// control bucket and what they hold (mode, layout, parking, unpark requests), the modes and
// receive kinds of a deployment. Replicas, setup, status, verify (package audit), replay and the
// bench all speak it, and none of them needs another's package to do so: audit, replay and status
// read what the lanes write without importing package lanes.
//
// It is a sibling of package subjects, not a part of it: subjects says where a message goes (the
// templates, the partition of a device, the streams' names and subjects), wire says what it
// carries and what the control bucket records; either changes without the other. Like subjects
// it imports only the standard library and performs no I/O. A protocol that one package both
// writes and reads, and no user sees, stays in that package (direct's owner-to-owner transfer
// headers and markers).
package wire
