package wire

import (
	"strconv"
	"strings"
	"time"
)

// Incarnation names one life of a stream: its creation time as a short token (base 36 of the
// Unix nanoseconds). A stream deleted and created again under the same name has another one.
// Checkpoints and Nats-Msg-Ids carry it, so that neither is taken for a position in, or a
// message of, another life of INCOMING: its sequences start again at 1.
func Incarnation(created time.Time) string {
	return strconv.FormatInt(created.UnixNano(), 36)
}

// MsgIDPrefix is the start of the Nats-Msg-Id of every message republished from one
// incarnation of the stream named incoming: "<incoming>:<incarnation>:", followed by the
// message's INCOMING sequence ([AppendMsgID]).
func MsgIDPrefix(incoming, incarnation string) string {
	return incoming + ":" + incarnation + ":"
}

// LegacyMsgIDPrefix is the start of the Nats-Msg-Id kvmapper wrote before ids named the
// incarnation of INCOMING: "<incoming>:", followed by the sequence.
func LegacyMsgIDPrefix(incoming string) string { return incoming + ":" }

// ReplayMsgIDPrefix is the start of the Nats-Msg-Id of every message replay run id publishes
// from one incarnation of stream: "replay:<id>:<stream>:<incarnation>:", followed by the
// message's sequence in stream.
func ReplayMsgIDPrefix(id, stream, incarnation string) string {
	return "replay:" + id + ":" + MsgIDPrefix(stream, incarnation)
}

// AppendMsgID appends the Nats-Msg-Id of sequence seq, "<prefix><seq>", to dst.
func AppendMsgID(dst []byte, prefix string, seq uint64) []byte {
	return strconv.AppendUint(append(dst, prefix...), seq, 10)
}

// ParseMsgID returns the sequence of a Nats-Msg-Id "<prefix><sequence>", and false when id does
// not start with prefix or its sequence is not a decimal number above 0. It does not allocate
// when it succeeds.
func ParseMsgID(id, prefix string) (uint64, bool) {
	rest, ok := strings.CutPrefix(id, prefix)
	if !ok || rest == "" || rest[0] < '0' || rest[0] > '9' {
		return 0, false
	}
	seq, err := strconv.ParseUint(rest, 10, 64)
	if err != nil || seq == 0 {
		return 0, false
	}
	return seq, true
}
