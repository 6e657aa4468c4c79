package subjects

import (
	"fmt"
	"strings"
)

// span is a half-open byte range of a subject.
type span struct{ start, end int }

// Fields are the placeholder values of one stored INCOMING subject, kept as spans into that subject
// so that [Layout.Parse] and the accessors never allocate. The zero value is ready to use and
// reports empty values; reuse one per lane. Fields is not safe for concurrent use.
type Fields struct {
	subject   string
	partition int
	dev       int // index of {device} in spans
	spans     [MaxPlaceholders]span
	layout    *Layout
}

// Device returns the {device} token, a substring of the parsed subject.
func (f *Fields) Device() string {
	sp := f.spans[f.dev]
	return f.subject[sp.start:sp.end]
}

// Partition returns the partition token of the parsed subject.
func (f *Fields) Partition() int { return f.partition }

// Subject returns the parsed subject.
func (f *Fields) Subject() string { return f.subject }

// Value returns the value of the In placeholder name, or "" if In has no such placeholder.
func (f *Fields) Value(name string) string {
	if f.layout == nil {
		return ""
	}
	i := f.layout.inIndex(name)
	if i < 0 {
		return ""
	}
	sp := f.spans[i]
	return f.subject[sp.start:sp.end]
}

// Parse fills f from a stored INCOMING subject such as "incoming.7.dev-42.temp". It does not
// allocate when it succeeds. On failure it resets f and returns an error wrapping
// [ErrMalformedSubject]: wrong token count, literal mismatch, empty or wildcard token, or a partition
// token that is not a decimal number below l.Partitions in the server's form (no sign, no leading
// zero). Parse does not check that the partition token is the hash of the device: the server
// assigned it, and the lane must follow what is stored.
func (l *Layout) Parse(stored string, f *Fields) error {
	if !strings.HasPrefix(stored, l.inPrefixDot) {
		return l.parseError(stored, f, "does not start with "+l.inPrefixDot)
	}
	i := len(l.inPrefixDot)
	j := strings.IndexByte(stored[i:], '.')
	if j < 0 {
		return l.parseError(stored, f, "too few tokens")
	}
	p, ok := parsePartition(stored[i:i+j], l.Partitions)
	if !ok {
		return l.parseError(stored, f, fmt.Sprintf("partition token %q is not a number from 0 to %d", stored[i:i+j], l.Partitions-1))
	}
	i += j + 1
	ph := 0
	for k, tk := range l.inRest {
		end := len(stored)
		j := strings.IndexByte(stored[i:], '.')
		switch {
		case k < len(l.inRest)-1 && j < 0:
			return l.parseError(stored, f, "too few tokens")
		case k == len(l.inRest)-1 && j >= 0:
			return l.parseError(stored, f, "too many tokens")
		case j >= 0:
			end = i + j
		}
		tok := stored[i:end]
		switch {
		case tok == "":
			return l.parseError(stored, f, "empty token")
		case !tk.ph:
			if tok != tk.text {
				return l.parseError(stored, f, fmt.Sprintf("token %q where %q was expected", tok, tk.text))
			}
		case tok == "*" || tok == ">":
			return l.parseError(stored, f, "wildcard token")
		default:
			f.spans[ph] = span{i, end}
			ph++
		}
		i = end + 1
	}
	f.subject, f.partition, f.dev, f.layout = stored, p, l.devIdx, l
	return nil
}

func (l *Layout) parseError(stored string, f *Fields, why string) error {
	*f = Fields{}
	return fmt.Errorf("%w: %q: %s (want %s)", ErrMalformedSubject, stored, why, l.storedShape)
}

// parsePartition parses a partition token exactly as the server writes it (strconv.Itoa), so that
// every accepted subject renders back to itself.
func parsePartition(s string, n int) (int, bool) {
	if s == "" || len(s) > 1 && s[0] == '0' || len(s) > 4 {
		return 0, false
	}
	p := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		p = p*10 + int(c-'0')
	}
	return p, p < n
}

// AppendOut appends the Out subject for f and the device's values v to dst and returns the
// extended slice. It does not allocate when dst has room. It does not check v: decode it once,
// with l.Schema(), when the value is read. f must have been filled by l.Parse.
func (l *Layout) AppendOut(dst []byte, f *Fields, v Values) []byte {
	ops := l.outOps
	if v.Len() == l.fastLen {
		ops = l.outFast
	}
	return l.appendOps(dst, ops, f, v)
}

// AppendUnmapped appends the Unmapped subject for f to dst and returns the extended slice. It does
// not allocate when dst has room. f must have been filled by l.Parse.
func (l *Layout) AppendUnmapped(dst []byte, f *Fields) []byte {
	return l.appendOps(dst, l.unmappedOps, f, Values{})
}

func (l *Layout) appendOps(dst []byte, ops []op, f *Fields, v Values) []byte {
	for _, o := range ops {
		switch o.kind {
		case opLit:
			dst = append(dst, o.text...)
		case opValue:
			if r, ok := get1(v.s, o.idx); ok {
				dst = append(dst, r...)
			} else {
				dst = append(dst, v.Get(o.idx)...)
			}
		case opField:
			sp := f.spans[o.idx]
			dst = append(dst, f.subject[sp.start:sp.end]...)
		}
	}
	return dst
}

// ParseOut fills f from a subject Out renders, for the placeholders of In that Out holds, so that
// [Layout.AppendOut] and [Layout.AppendHeader] can render it again, e.g. to check it against the
// device's value. It returns complete false when In has a placeholder Out lacks (a header using
// it cannot be rendered again from the subject). It fails, resetting f, when subject does not
// have Out's shape: another token count, a literal that differs, an empty token. f's partition
// is -1: Out does not carry it.
func (l *Layout) ParseOut(subject string, f *Fields) (complete bool, err error) {
	*f = Fields{subject: subject, partition: -1, dev: l.devIdx, layout: l}
	var set [MaxPlaceholders]bool
	i := 0
	for k, tk := range l.Out.tokens {
		end := len(subject)
		j := strings.IndexByte(subject[i:], '.')
		switch {
		case k < len(l.Out.tokens)-1 && j < 0, k == len(l.Out.tokens)-1 && j >= 0:
			*f = Fields{}
			return false, fmt.Errorf("%w: %q does not have the shape of %s", ErrMalformedSubject, subject, l.Out)
		case j >= 0:
			end = i + j
		}
		tok := subject[i:end]
		switch idx := l.inIndex(tk.text); {
		case tok == "" || !tk.ph && tok != tk.text:
			*f = Fields{}
			return false, fmt.Errorf("%w: %q does not have the shape of %s", ErrMalformedSubject, subject, l.Out)
		case tk.ph && idx >= 0 && !set[idx]:
			f.spans[idx], set[idx] = span{i, end}, true
		}
		i = end + 1
	}
	for idx := range l.In.names {
		if !set[idx] {
			return false, nil
		}
	}
	return true, nil
}
