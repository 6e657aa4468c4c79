package subjects

import (
	"strconv"
	"strings"
)

// ParseAckReply returns the stream sequence and the consumer's pending count from the reply
// subject of a JetStream message, without allocating (jetstream.Msg.Metadata allocates). It
// reads both forms the server uses:
//
//	$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>
//	$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>[.<token>]
//
// ok is false when reply is neither.
func ParseAckReply(reply string) (streamSeq, pending uint64, ok bool) {
	if !strings.HasPrefix(reply, "$JS.ACK.") {
		return 0, 0, false
	}
	var seqAt, pendingAt int
	switch n := strings.Count(reply, ".") + 1; {
	case n == 9:
		seqAt, pendingAt = 5, 8
	case n >= 11:
		seqAt, pendingAt = 7, 10
	default:
		return 0, 0, false
	}
	var err1, err2 error
	for i := 0; i <= pendingAt; i++ {
		tok := reply
		if j := strings.IndexByte(reply, '.'); j >= 0 {
			tok, reply = reply[:j], reply[j+1:]
		}
		switch i {
		case seqAt:
			streamSeq, err1 = strconv.ParseUint(tok, 10, 64)
		case pendingAt:
			pending, err2 = strconv.ParseUint(tok, 10, 64)
		}
	}
	return streamSeq, pending, err1 == nil && err2 == nil
}
