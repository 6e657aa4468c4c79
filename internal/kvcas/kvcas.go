// Package kvcas tells a failed compare-and-set on a JetStream KV bucket (or a stream write with
// an expected last sequence) from every other error, in each of the shapes nats.go reports it.
// The packages that write with compare-and-set translate it into their own errors.
package kvcas

import (
	"errors"

	"github.com/nats-io/nats.go/jetstream"
)

// IsConflict reports whether err is a compare-and-set conflict: someone else wrote first. The
// server answers "wrong last sequence", 10071, which the KV calls report as ErrKeyExists and
// ErrKeyRevisionMismatch; nats.go documents 10164 for the same conflict on replicated streams
// and maps it in its KV calls, but a raw publish with an expected sequence would return the API
// error itself, so both codes are checked. (nats-server 2.15.2 answered 10071 on an R3 bucket to
// every write TestIsConflictReplicated makes: the 10164 case is nats.go's word, not observed.)
func IsConflict(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
	}
	return false
}
