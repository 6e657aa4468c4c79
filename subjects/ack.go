package subjects

import (
	"strconv"
	"strings"
)

// Ack is what the reply subject of a JetStream message tells about it.
type Ack struct {
	StreamSeq uint64 // the message's sequence in its stream
	// ConsumerSeq is the consumer's delivery sequence: 1 for the first message a consumer
	// delivers, so an ordered consumer that recreated itself starts again at 1.
	ConsumerSeq uint64
	Pending     uint64 // messages left for the consumer after this one
	Time        int64  // when the stream stored the message, in Unix nanoseconds
}

// ParseAck reads the reply subject of a JetStream message without allocating
// (jetstream.Msg.Metadata allocates). It reads both forms the server uses:
//
//	$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>
//	$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>[.<token>]
//
// ok is false when reply is neither.
func ParseAck(reply string) (a Ack, ok bool) {
	if !strings.HasPrefix(reply, "$JS.ACK.") {
		return Ack{}, false
	}
	var seqAt int
	switch n := strings.Count(reply, ".") + 1; {
	case n == 9:
		seqAt = 5
	case n >= 11:
		seqAt = 7
	default:
		return Ack{}, false
	}
	cseqAt, timeAt, pendingAt := seqAt+1, seqAt+2, seqAt+3
	var err1, err2, err3, err4 error
	for i := 0; i <= pendingAt; i++ {
		tok := reply
		if j := strings.IndexByte(reply, '.'); j >= 0 {
			tok, reply = reply[:j], reply[j+1:]
		}
		switch i {
		case seqAt:
			a.StreamSeq, err1 = strconv.ParseUint(tok, 10, 64)
		case cseqAt:
			a.ConsumerSeq, err2 = strconv.ParseUint(tok, 10, 64)
		case timeAt:
			a.Time, err4 = strconv.ParseInt(tok, 10, 64)
		case pendingAt:
			a.Pending, err3 = strconv.ParseUint(tok, 10, 64)
		}
	}
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
		return Ack{}, false
	}
	return a, true
}

// ParseAckReply returns the stream sequence and the consumer's pending count from the reply
// subject of a JetStream message, as [ParseAck] reads it.
func ParseAckReply(reply string) (streamSeq, pending uint64, ok bool) {
	a, ok := ParseAck(reply)
	return a.StreamSeq, a.Pending, ok
}
