package fiprobe_test

import (
	"testing"
)

// TestOneMessageBatch: a batch of one message sent with the commit operation (op 2 at batch
// sequence 1) is answered like a single publish: one PubAck naming the stream sequence, and no
// flow acknowledgement. When the message is a duplicate the PubAck says so ("duplicate": true)
// and names the sequence of the copy stored first, as a single publish's does. So a writer that
// sends one message at a time (after a takeover, while what a previous owner stored is resent)
// learns from a batch of one exactly what it learns from a single publish.
func TestOneMessageBatch(t *testing.T) {
	t.Parallel()
	_, nc, js := outgoing(t, nil)
	publish(t, js, msg("outgoing.g.d.t", "old-1"))

	b := newBatch(t, nc, 500, false)
	b.commit(msg("outgoing.g.d.t", "new-1"))
	got, ack := b.all(wait)
	if len(got) != 1 || ack.Seq != 2 || ack.Count != 1 || ack.Duplicate || ack.Error != nil {
		t.Fatalf("answers %v: want only a PubAck of stream sequence 2, count 1", got)
	}

	d := newBatch(t, nc, 500, false)
	d.commit(msg("outgoing.g.d.t", "old-1"))
	got, ack = d.all(wait)
	if len(got) != 1 || !ack.Duplicate || ack.Seq != 1 || ack.Count != 1 {
		t.Fatalf("answers %v: want only a PubAck with duplicate true, stream sequence 1 (the first copy), count 1", got)
	}
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), []string{"old-1", "new-1"})
}

// TestCommittedBatch: a batch whose last message carries the commit operation is answered with
// the first flow acknowledgement (batch sequence 0, sent when the first message is accepted)
// and, once every message is persisted, one PubAck naming the stream sequence of the last one
// and the count. A duplicate anywhere in it is skipped and counted; a duplicate last message
// still commits the batch, and the PubAck names the last message stored. An end of batch (op 3)
// sent to a batch already committed is refused as unknown (10208): a writer that lost the PubAck
// cannot ask again, it must read the stream or resend.
func TestCommittedBatch(t *testing.T) {
	t.Parallel()
	_, nc, js := outgoing(t, nil)
	publish(t, js, msg("outgoing.g.d.t", "old-1"))

	b := newBatch(t, nc, 500, false)
	b.add(msg("outgoing.g.d.t", "m-1"))
	b.add(msg("outgoing.g.d.t", "old-1"))
	b.add(msg("outgoing.g.d.t", "m-3"))
	b.commit(msg("outgoing.g.d.t", "m-1"))
	got, ack := b.all(wait)
	if len(got) != 2 || got[0].Type != "ack" || got[0].Seq != 0 {
		t.Fatalf("answers %v: want the first flow acknowledgement (seq 0), then the PubAck", got)
	}
	if ack.Seq != 3 || ack.Count != 4 || ack.Duplicate {
		t.Fatalf("PubAck %s: want stream sequence 3 (m-3, the last stored), count 4", ack)
	}
	sameIDs(t, "OUTGOING", stored(t, js, "OUTGOING"), []string{"old-1", "m-1", "m-3"})

	b.end("outgoing.g.d.t")
	a := b.next(wait)
	if a.Error == nil || a.Error.ErrorCode != 10208 {
		t.Fatalf("end of a committed batch: answer %s, want 10208 batch unknown", a)
	}
}
