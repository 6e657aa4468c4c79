// Package ordered publishes messages to JetStream streams in the order they are given, and says
// of each one when the stream has persisted it. It is the write path of the lanes (OUTGOING,
// UNMAPPED, PARKED), of the park drains and of replay, under one contract:
//
//   - a message counts as handled ([Msg.Stored]) only once its stream persisted it or reported it
//     a duplicate of one it holds (its Nats-Msg-Id);
//   - after any failure nothing new is sent until every message in flight has its outcome; then
//     every message not known stored is sent again, in order;
//   - nothing later of a stream is ever stored before something earlier of it that the writer
//     has not seen stored: a later message of a device cannot overtake an earlier one.
//
// A stream that allows it (allow_batched, nats-server 2.14+) is written in fast-ingest batches
// with gap: fail ([ModeBatch]): the server stores a prefix of each batch and nothing after a
// message it lost or refused, also across a leader change, so the last rule holds by
// construction. One batch per stream is in process at a time; a batch is what is ready while the
// previous one commits, and is committed as soon as its sender has nothing more ready ([Writer.Flush]),
// so a message never waits for a batch to fill. Other streams are written with single
// publishes, pipelined ([ModeSingle]): the writer notices a later message stored while an
// earlier one is unanswered, but the later one is stored by then (a leader change can do that).
//
// A batch says which messages it stored, not which of them were duplicates, nor where each one
// is: [Msg.Duplicate] and [Msg.Seq] are known for single publishes and for messages sent one at
// a time. Where duplicates are expected — the first messages after a claim ([Writer.Probe]),
// and whatever a batch whose outcome was lost may or may not have stored — a batch-mode writer
// sends one message at a time, each a batch of one answered like a single publish, until one is
// stored as new: the counts of duplicates stay exact where they can be non-zero.
//
// A Writer belongs to one goroutine, as does the [Inbox] its answers come on; the Inbox serves
// several writers (a lane's own and its drains'). Leases, the room in flight and what a refused
// message becomes are left to the caller ([Hooks]).
package ordered
