package subjects_test

import (
	"testing"

	"github.com/kvmapper/kvmapper/subjects"
)

func TestParseAckReply(t *testing.T) {
	for _, tc := range []struct {
		reply        string
		seq, pending uint64
		ok           bool
	}{
		{"$JS.ACK.INCOMING.cons.1.42.7.1700000000000000000.5", 42, 5, true},
		{"$JS.ACK.hub.ACCHASH.INCOMING.cons.1.42.7.1700000000000000000.5.rand", 42, 5, true},
		{"$JS.ACK.hub.ACCHASH.INCOMING.cons.1.42.7.1700000000000000000.5", 42, 5, true},
		{"$JS.ACK.INCOMING.cons.1.x.7.1700000000000000000.5", 0, 0, false},
		{"_INBOX.abc", 0, 0, false},
		{"$JS.ACK.too.short", 0, 0, false},
		{"", 0, 0, false},
	} {
		seq, pending, ok := subjects.ParseAckReply(tc.reply)
		if ok != tc.ok || (ok && (seq != tc.seq || pending != tc.pending)) {
			t.Errorf("ParseAckReply(%q) = %d, %d, %v; want %d, %d, %v", tc.reply, seq, pending, ok, tc.seq, tc.pending, tc.ok)
		}
	}
	if n := testing.AllocsPerRun(100, func() {
		subjects.ParseAckReply("$JS.ACK.INCOMING.cons.1.42.7.1700000000000000000.5")
	}); n != 0 {
		t.Errorf("ParseAckReply allocates %v times per call, want 0", n)
	}
}

func TestParseAckConsumerSeq(t *testing.T) {
	for _, reply := range []string{
		"$JS.ACK.INCOMING.cons_2.1.42.7.1700000000000000000.5",
		"$JS.ACK.hub.ACCHASH.INCOMING.cons_2.1.42.7.1700000000000000000.5.rand",
	} {
		a, ok := subjects.ParseAck(reply)
		if want := (subjects.Ack{StreamSeq: 42, ConsumerSeq: 7, Pending: 5, Time: 1700000000000000000}); !ok || a != want {
			t.Errorf("ParseAck(%q) = %+v, %v; want %+v, true", reply, a, ok, want)
		}
	}
	if _, ok := subjects.ParseAck("$JS.ACK.INCOMING.cons.1.42.x.1700000000000000000.5"); ok {
		t.Error("ParseAck with a consumer sequence that is not a number: ok, want not ok")
	}
}

func FuzzParseAckReply(f *testing.F) {
	f.Add("$JS.ACK.INCOMING.cons.1.42.7.1700000000000000000.5")
	f.Add("$JS.ACK.hub.ACCHASH.INCOMING.cons.1.42.7.1700000000000000000.5.rand")
	f.Fuzz(func(t *testing.T, reply string) {
		subjects.ParseAckReply(reply) // must not panic
	})
}
