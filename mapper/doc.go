// Package mapper is one kvmapper replica: it composes the groups table (package kv), the lanes
// that map each owned partition (package lanes; in direct mode package direct) and the election
// that hands partitions to them (package election), and observes them (metrics, the status service, ownership events). It
// receives a JetStream handle and leaves dialling NATS, flags and exit codes to its caller.
package mapper
