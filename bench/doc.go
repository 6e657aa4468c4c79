// Package bench measures kvmapper against the alternatives in one run against one NATS server:
// throughput beside a server-side stream copy, a server-side subject transform and a naive
// one-at-a-time mapper; end-to-end latency beside publishing straight into OUTGOING; how fast a
// group change takes effect; the groups table at scale; and the unowned gap when a replica is
// killed. Ratios matter, not absolute figures. It leaves running kvmapper itself to the caller,
// which passes a [ReplicaFunc] (a replica in this process) and a [ChildFunc] (a replica as a child
// process, for a real kill), and leaves starting the server and printing flags to package main.
package bench
