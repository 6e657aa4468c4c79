package ordered

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

var (
	ackError     = []byte(`"error"`)
	ackDuplicate = []byte(`"duplicate"`)
	ackSeq       = []byte(`"seq"`)
	ackTrue      = []byte("true")
)

// parseAck reads a JetStream publish acknowledgement without decoding JSON on the happy path:
// {"stream":"OUTGOING","seq":12} or with "duplicate":true, where seq is the sequence of the copy
// stored first. An error answer is decoded into the server's *jetstream.APIError; a "no
// responders" status means no stream captures the subject.
func parseAck(m *nats.Msg) (duplicate bool, seq uint64, err error) {
	if len(m.Data) == 0 {
		if m.Header.Get("Status") == "503" {
			return false, 0, errNoStream
		}
		return false, 0, errBadAck
	}
	if bytes.Contains(m.Data, ackError) {
		var r struct {
			Error *jetstream.APIError `json:"error"`
		}
		if json.Unmarshal(m.Data, &r) != nil || r.Error == nil {
			return false, 0, fmt.Errorf("%w: %q", errBadAck, m.Data)
		}
		return false, 0, r.Error
	}
	seqAt := afterKey(m.Data, ackSeq)
	if seqAt < 0 {
		return false, 0, fmt.Errorf("%w: %q", errBadAck, m.Data)
	}
	for ; seqAt < len(m.Data) && '0' <= m.Data[seqAt] && m.Data[seqAt] <= '9'; seqAt++ {
		seq = seq*10 + uint64(m.Data[seqAt]-'0')
	}
	// The server writes "duplicate": true with a space, a JSON encoder without one.
	dupAt := afterKey(m.Data, ackDuplicate)
	return dupAt >= 0 && bytes.HasPrefix(m.Data[dupAt:], ackTrue), seq, nil
}

var ackStreamKey = []byte(`"stream"`)

// ackStream returns the stream an acknowledgement names, or "".
func ackStream(b []byte) string {
	i := afterKey(b, ackStreamKey)
	if i < 0 || i >= len(b) || b[i] != '"' {
		return ""
	}
	j := bytes.IndexByte(b[i+1:], '"')
	if j < 0 {
		return ""
	}
	return string(b[i+1 : i+1+j])
}

// afterKey returns where the value of key (quoted) starts in the JSON object b, or -1.
func afterKey(b, key []byte) int {
	i := bytes.Index(b, key)
	if i < 0 {
		return -1
	}
	for i += len(key); i < len(b) && (b[i] == ':' || b[i] == ' '); i++ {
	}
	return i
}

// errCodeDuplicateInProcess is nats-server's JSStreamDuplicateMessageConflict, "duplicate
// message id is in process", which nats.go has no constant for: the stream is storing a message
// with the same Nats-Msg-Id (a publish whose answer the lane stopped waiting for) and has not
// finished.
const errCodeDuplicateInProcess jetstream.ErrorCode = 10158

// inProcess tells the answer to a publish whose message the stream is already storing under an
// earlier publish (see [errCodeDuplicateInProcess]).
func inProcess(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeDuplicateInProcess
}
