// Package direct maps device messages before any stream holds them. A device publishes with an
// ordinary JetStream publish to incoming.{device}.{event}; no stream captures that subject, so the
// message reaches the owner of its partition over core NATS with its reply subject intact. The
// owner looks the device's group up and republishes the message with a plain core publish to
// outgoing.{group}.{device}.{event} (or to UNMAPPED with a reason), keeping the reply subject,
// the payload and the device's headers, so that OUTGOING's acknowledgement goes straight to the
// device. A partition is received through the server's account mapping, which stamps the
// partition on what devices publish (each owner subscribes to its partitions only), or, with no
// server configuration, through one subscription to every device subject per replica, which
// keeps its partitions. A partition handed over gracefully passes from the old owner to the new
// one with no message lost or forwarded twice: the old owner keeps forwarding until the new one
// has subscribed, then tells it which messages it forwarded: in kvmapper "handoff" names this
// owner-to-owner protocol only (its headers KVMapper-Handoff-*, --handoff-timeout); a lease
// changing hands is a handover (package election). Leases, the groups table and
// dialling NATS are left to the caller: a partition runs under the context it is handed, and
// stops when that context ends or its lease's clock runs out.
package direct
