// Package status is how kvmapper replicas describe themselves over NATS, and how anyone with a
// NATS connection reads that back. A replica runs a [Service]: a NATS micro service named
// "kvmapper" with a status endpoint of its own (no queue group), answering a [Report]. It
// publishes its own ownership changes as [Event]s with [Events]. [Read] assembles a [Snapshot]
// of every partition, replica and the groups bucket from the control bucket, the streams and the
// replicas' reports, and [Snapshot.WriteText] renders it. It reads the control bucket's key
// layout (lease.<p>, member.<id>, checkpoint.<p>) but leaves writing it to packages election and
// lanes, and leaves dialling NATS to the caller.
package status
