// Package fiprobe holds no code: its tests pin down what nats-server's fast-ingest batch publish
// (stream option allow_batched, nats-server 2.14+) does on the wire, the facts a batched write
// path in lanes would rest on: what flow acknowledgements carry and how often, what a refused,
// duplicate or lost message does to its batch, how long an abandoned batch lives, and what a
// leader change does. They speak the protocol with plain core publishes, not through a client
// library, so that every answer the server sends is seen. BENCHMARKS-fastbatch.md cites them.
package fiprobe
