// Package audit checks a kvmapper deployment from the outside: it reads the OUTGOING and UNMAPPED
// streams completely and compares what it finds with the range of INCOMING, reporting per-device
// reorders (I1), duplicates and gaps (I2) and writes by a deposed owner (I3, from the provenance
// headers). It needs only a jetstream.JetStream and the subject layout, never the control bucket
// or a running mapper; dialing NATS, printing the report and choosing an exit code are left to the
// caller (kvmapper verify).
package audit
