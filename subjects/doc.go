// Package subjects describes where kvmapper reads and writes messages: it parses the subject templates
// (incoming.{device}.{event}, outgoing.{group}.{device}.{event}, unmapped.{device}.{event}) and the
// output header templates (Tenant={tenant}) into a [Layout], derives from it the stream subjects and
// the server-side partition transform, parses stored INCOMING subjects, decodes a device's value (a
// group, or a JSON object of fields) once into the [Values] its templates need and renders OUT and
// UNMAPPED subjects and output headers from them without allocating, computes the partition of a
// device exactly as nats-server's {{partition(n,i)}} transform does, and validates the tokens a value
// may give. It imports only the standard library and performs no I/O: creating streams, looking
// values up and publishing are left to the packages that use it.
package subjects
