// Package bench measures kvmapper against the alternatives in one run against one NATS server:
// throughput beside a server-side stream copy, a server-side subject transform and a naive
// one-at-a-time mapper; end-to-end latency beside publishing straight into OUTGOING and beside a
// bare relay; how fast a group change takes effect; the groups table at scale; and the unowned
// gap when a replica is killed. Ratios matter, not absolute figures. It runs kvmapper replicas in this process with
// package mapper, as `kvmapper run` does; replicas as child processes (for a real kill) come from
// the caller's [ChildFunc], and starting the server and printing flags are left to package main.
package bench
