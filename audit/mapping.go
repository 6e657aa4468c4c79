package audit

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// maxCachedRevisions bounds the values a mapping check keeps decoded: past it, the cache starts
// again empty.
const maxCachedRevisions = 1 << 18

// revision is one value of the groups bucket as a mapping check read it.
type revision struct {
	key   string // the device it is the value of
	entry kv.Entry
	gone  bool // the bucket no longer holds it: the message cannot be checked
	del   bool // the revision deletes or purges its key: no message can be mapped with it
}

// mappingCheck checks each message of OUTGOING against the value it was mapped with: the
// revision of the groups bucket its KVMapper-Prov header names, decoded by the templates'
// schema, must be a value of the message's device, one the templates can use, and render the
// message's subject and output headers exactly. It reads each revision once (a direct get on the
// bucket's stream) and keeps it decoded. Its state belongs to the OUTGOING reader's goroutine.
type mappingCheck struct {
	lay    *subjects.Layout
	bucket string
	stream jetstream.Stream // nil when the bucket cannot be read: nothing is checked
	prefix string           // "$KV.<bucket>."
	cache  map[uint64]revision
	fields subjects.Fields
	buf    []byte
	// off says why nothing more is checked: the bucket cannot be read (gone, or not allowed).
	off string

	checked, unchecked uint64
}

func newMappingCheck(ctx context.Context, js jetstream.JetStream, lay *subjects.Layout, bucket string) *mappingCheck {
	c := &mappingCheck{lay: lay, bucket: bucket, prefix: "$KV." + bucket + ".", cache: map[uint64]revision{}}
	// A user not allowed to read the bucket may get no answer at all: then nothing is checked.
	s, err := streamIfAllowed(ctx, js, subjects.BucketStream(bucket), nil)
	if err != nil {
		c.off = fmt.Sprintf("cannot read the groups bucket %s: %v", bucket, err)
		return c
	}
	c.stream = s
	return c
}

// check checks one OUTGOING message of device; it returns the finding's detail when the message
// does not match its value, "" when it does or cannot be checked (then it counts it unchecked).
func (c *mappingCheck) check(ctx context.Context, subject string, hdr nats.Header, device string) (string, error) {
	pv, _ := wire.ReadProvenance(hdr.Get)
	rev := pv.Revision
	if rev == 0 || c.off != "" || device == "" {
		c.unchecked++ // no provenance (--no-provenance), or the bucket is gone
		return "", nil
	}
	v, err := c.revision(ctx, rev)
	if err != nil {
		if ctx.Err() != nil {
			return "", err
		}
		// The bucket answers no more (not allowed, gone): the rest is not checked; the audit of
		// order and gaps goes on.
		c.off = err.Error()
		c.unchecked++
		return "", nil
	}
	switch {
	case v.gone:
		c.unchecked++
		return "", nil
	case v.del:
		c.checked++
		return fmt.Sprintf("mapped with revision %d of %s, which deletes key %s: no value (subject %s)", rev, c.bucket, v.key, subject), nil
	case v.key != device:
		c.checked++
		return fmt.Sprintf("mapped with revision %d of %s, the value of %s, not of %s (subject %s)", rev, c.bucket, v.key, device, subject), nil
	case v.entry.Invalid:
		c.checked++
		return fmt.Sprintf("mapped with revision %d of %s, whose value the templates cannot use (%s: %s) (subject %s)", rev, c.bucket, v.entry.Reason, v.entry.Detail, subject), nil
	}
	c.checked++
	complete, err := c.lay.ParseOut(subject, &c.fields)
	if err != nil {
		return fmt.Sprintf("subject %s does not have the shape of %s", subject, c.lay.Out), nil
	}
	c.buf = c.lay.AppendOut(c.buf[:0], &c.fields, v.entry.Values)
	if string(c.buf) != subject {
		return fmt.Sprintf("subject %s, but revision %d of %s's value renders %s", subject, rev, device, c.buf), nil
	}
	if !complete {
		return "", nil // the headers may use a placeholder of in the subject does not carry
	}
	for i := range c.lay.NumHeaders() {
		c.buf = c.lay.AppendHeader(c.buf[:0], i, &c.fields, v.entry.Values)
		name := c.lay.HeaderName(i)
		if got, ok := hdr[name]; !ok || len(got) != 1 || got[0] != string(c.buf) {
			return fmt.Sprintf("header %s %q, but revision %d of %s's value renders %q (subject %s)", name, hdr.Values(name), rev, device, c.buf, subject), nil
		}
	}
	return "", nil
}

// revision returns revision rev of the bucket, read and decoded once.
func (c *mappingCheck) revision(ctx context.Context, rev uint64) (revision, error) {
	if v, ok := c.cache[rev]; ok {
		return v, nil
	}
	var v revision
	m, err := whileUnavailable(ctx, nil, func(ctx context.Context) (*jetstream.RawStreamMsg, error) {
		return c.stream.GetMsg(ctx, rev)
	})
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		v.gone = true
	case err != nil:
		return v, fmt.Errorf("audit: reading revision %d of bucket %s: %w", rev, c.bucket, err)
	default:
		v.key = m.Subject[min(len(c.prefix), len(m.Subject)):]
		switch m.Header.Get("KV-Operation") {
		case "DEL", "PURGE":
			v.del = true
		default:
			if m.Header.Get(jetstream.MarkerReasonHeader) != "" {
				v.del = true
			} else {
				v.entry = kv.DecodeEntry(c.lay.Schema(), m.Data, rev)
			}
		}
	}
	if len(c.cache) >= maxCachedRevisions {
		clear(c.cache)
	}
	c.cache[rev] = v
	return v, nil
}
