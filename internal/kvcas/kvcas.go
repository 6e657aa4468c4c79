// Package kvcas tells a failed compare-and-set on a JetStream KV bucket (or a stream write with
// an expected last sequence) from every other error, in each of the shapes nats.go reports it.
// The packages that write with compare-and-set translate it into their own errors.
package kvcas

import (
	"errors"

	"github.com/nats-io/nats.go/jetstream"
)

// IsConflict reports whether err is a compare-and-set conflict: someone else wrote first. On R1
// buckets the server answers "wrong last sequence" (10071), which nats.go's KV calls report as
// ErrKeyExists; on replicated ones the code differs (10164), and a raw publish with an expected
// sequence reports the API error itself.
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
