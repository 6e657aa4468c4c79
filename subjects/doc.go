// Package subjects describes where kvmapper reads and writes messages: it parses the subject templates
// (incoming.{device}.{event}, outgoing.{group}.{device}.{event}, unmapped.{device}.{event}) into a
// [Layout], derives from it the stream subjects and the server-side partition transform, parses stored
// INCOMING subjects and renders OUT and UNMAPPED subjects without allocating, computes the partition
// of a device exactly as nats-server's {{partition(n,i)}} transform does, and validates the tokens a
// group may take. It imports only the standard library and performs no I/O: creating streams, looking
// groups up and publishing are left to the packages that use it.
package subjects
