// Package kvcas tells a failed compare-and-set on a JetStream KV bucket (or a stream write with
// an expected last sequence) from every other error, in each of the shapes nats.go reports it,
// and reads back what a conflict ran into from the bucket's leader. The packages that write with
// compare-and-set translate it into their own errors.
package kvcas

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// IsConflict reports whether err is a compare-and-set conflict: someone else wrote first, and the
// key holds another revision than the one expected. The server answers "wrong last sequence",
// 10071, which the KV calls report as ErrKeyExists and ErrKeyRevisionMismatch. The same words
// with code 10164 mean something else, which [InProcess] tells: IsConflict is false for it.
func IsConflict(err error) bool {
	if err == nil || InProcess(err) {
		return false
	}
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence
	}
	return false
}

// InProcess reports whether err is the refusal of a compare-and-set write because another write
// of the same key is still being applied (a replicated stream's leader proposed it and has not
// applied it yet): "wrong last sequence" with code 10164, JSStreamWrongLastSequenceConstantErr
// (nats-server 2.15 jetstream_batching.go: "If the subject is already in process, block").
// Nothing was written; the key still holds the revision it had, and the write in process may
// change it or not. A writer whose own earlier write timed out meets it when that write is
// slow to be applied: it is not a conflict with anyone, and the write is to be tried again.
// nats.go's KV calls report it as ErrKeyExists, like a conflict.
func InProcess(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}

// ErrNotFound is returned by [Latest] when the bucket holds no message for the key.
var ErrNotFound = errors.New("kvcas: no message for the key")

// Latest returns the last message the bucket's stream holds for key (a value, or a delete or
// purge marker: see [Deleted]), with its headers and revision, read from the stream's leader.
//
// A KV Get, or a direct get of a stream, is answered by any replica of a replicated bucket,
// which may not have applied the latest writes yet (seen on an R3 bucket under load: 8 of 200
// reads right after an acknowledged write): read back after a conflict, it can show a revision
// older than the one that conflicted. The leader has applied every write it acknowledged.
// Latest asks $JS.API.STREAM.MSG.GET.KV_<bucket>, which only the leader answers.
func Latest(ctx context.Context, js jetstream.JetStream, bucket, key string) (*jetstream.RawStreamMsg, error) {
	m, err := LastOfSubject(ctx, js, "KV_"+bucket, "$KV."+bucket+"."+key)
	if err != nil && !errors.Is(err, ErrNotFound) {
		return nil, fmt.Errorf("kvcas: reading %s in bucket %s from its leader: %w", key, bucket, err)
	}
	return m, err
}

// LastOfSubject returns the last message stream holds on subject, with its headers and stream
// sequence, read from the stream's leader ($JS.API.STREAM.MSG.GET.<stream>, which only the
// leader answers; see [Latest] for why), or [ErrNotFound].
func LastOfSubject(ctx context.Context, js jetstream.JetStream, stream, subject string) (*jetstream.RawStreamMsg, error) {
	return get(ctx, js, stream, subject, msgGet{LastFor: subject})
}

// AtSeq returns the message at stream sequence seq of stream, with its headers, read from the
// stream's leader as [LastOfSubject] reads, or [ErrNotFound] when the stream holds none there
// (never stored, or removed since). A KV entry's revision is its stream sequence: AtSeq shows
// the headers of a revision the bucket's watch showed without them.
func AtSeq(ctx context.Context, js jetstream.JetStream, stream string, seq uint64) (*jetstream.RawStreamMsg, error) {
	return get(ctx, js, stream, "sequence "+strconv.FormatUint(seq, 10), msgGet{Seq: seq})
}

// msgGet is a $JS.API.STREAM.MSG.GET request.
type msgGet struct {
	Seq     uint64 `json:"seq,omitempty"`
	LastFor string `json:"last_by_subj,omitempty"`
	NextFor string `json:"next_by_subj,omitempty"`
}

// get asks stream's leader for the message req names, what the errors call it.
func get(ctx context.Context, js jetstream.JetStream, stream, what string, req msgGet) (*jetstream.RawStreamMsg, error) {
	subject := what
	body, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	m, err := js.Conn().RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+stream, body)
	if err != nil {
		return nil, fmt.Errorf("kvcas: reading %s in stream %s: %w", subject, stream, err)
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Subject string    `json:"subject"`
			Seq     uint64    `json:"seq"`
			Header  []byte    `json:"hdrs"`
			Data    []byte    `json:"data"`
			Time    time.Time `json:"time"`
		} `json:"message"`
	}
	if err := json.Unmarshal(m.Data, &resp); err != nil {
		return nil, fmt.Errorf("kvcas: reading %s in stream %s: %w in %q", subject, stream, err, m.Data)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return nil, ErrNotFound
	case resp.Error != nil:
		return nil, fmt.Errorf("kvcas: reading %s in stream %s: %w", subject, stream, resp.Error)
	case resp.Message == nil:
		return nil, fmt.Errorf("kvcas: reading %s in stream %s: no message in %q", subject, stream, m.Data)
	}
	out := &jetstream.RawStreamMsg{Subject: resp.Message.Subject, Sequence: resp.Message.Seq, Data: resp.Message.Data, Time: resp.Message.Time}
	if len(resp.Message.Header) > 0 {
		if out.Header, err = nats.DecodeHeadersMsg(resp.Message.Header); err != nil {
			return nil, fmt.Errorf("kvcas: reading %s in stream %s: %w", subject, stream, err)
		}
	}
	return out, nil
}

// Deleted reports whether m, a message [Latest] returned, marks its key deleted or purged, or
// is the server's marker of a key whose per-key TTL ran out (Nats-Marker-Reason), which KV
// watchers see as a purge.
func Deleted(m *jetstream.RawStreamMsg) bool {
	switch m.Header.Get("KV-Operation") {
	case "DEL", "PURGE":
		return true
	}
	return m.Header.Get("Nats-Marker-Reason") != ""
}

// NextOf returns the first message of stream at sequence seq or later whose subject matches
// filter (wildcards allowed; ">" for any), read from the stream's leader as [LastOfSubject]
// reads, or [ErrNotFound] when the leader holds none.
func NextOf(ctx context.Context, js jetstream.JetStream, stream, filter string, seq uint64) (*jetstream.RawStreamMsg, error) {
	return get(ctx, js, stream, filter+" from sequence "+strconv.FormatUint(seq, 10), msgGet{Seq: seq, NextFor: filter})
}
