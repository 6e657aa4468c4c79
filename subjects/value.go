package subjects

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
	"unsafe"
)

// Errors a [ValueError] wraps, one per way a device's value can fail the templates.
var (
	// ErrInvalidValue: the value starts with '{' but is not one valid JSON object, or names a
	// field the templates use twice.
	ErrInvalidValue = errors.New("subjects: invalid value")
	// ErrMissingField: the value has no field the templates use (or it is null).
	ErrMissingField = errors.New("subjects: missing field")
	// ErrInvalidField: a field the templates use cannot be rendered where it is used: not one valid
	// subject token in the out template, not a valid header value, or a nested object, an array
	// or a number with a fraction or an exponent.
	ErrInvalidField = errors.New("subjects: invalid field")
)

// MaxFields is the largest number of distinct value fields the out and header templates of one
// [Layout] may use together.
const MaxFields = 32

// MaxFieldLen is the longest a field used only in headers may be, in bytes; a field used in the
// out template is a subject token, at most [MaxTokenLen].
const MaxFieldLen = 1024

// ValueError says why a device's value cannot be rendered by the templates. It wraps
// [ErrInvalidValue], [ErrMissingField], [ErrInvalidField], or [ErrInvalidToken] for a plain
// value that is not one valid token where the templates use {group}.
type ValueError struct {
	// Field is the field at fault; "" when the value as a whole is (not JSON, or a plain value).
	Field string
	// Err is the sentinel.
	Err error
	// Detail says what is wrong, for people, naming the field and where the templates use it.
	Detail string
}

func (e *ValueError) Error() string { return e.Detail }

// Unwrap returns Err.
func (e *ValueError) Unwrap() error { return e.Err }

// A Field is one field of a device's value that the templates use.
type Field struct {
	Name string
	// Subject is set when the out template uses it: the field is one subject token.
	Subject bool
	// Headers are the output headers whose templates use it, in the order of the flags.
	Headers []string
}

// which is "which <where> use(s)", for error messages.
func (f Field) which() string {
	if n := len(f.Headers); n > 1 || n == 1 && f.Subject {
		return "which " + f.where() + " use"
	}
	return "which " + f.where() + " uses"
}

// where says where the templates use f, for error messages.
func (f Field) where() string {
	var parts []string
	if f.Subject {
		parts = append(parts, "the out template")
	}
	if len(f.Headers) == 1 {
		parts = append(parts, "header "+f.Headers[0])
	} else if len(f.Headers) > 1 {
		parts = append(parts, "headers "+strings.Join(f.Headers, ", "))
	}
	return strings.Join(parts, " and ")
}

// Schema is what the templates of a [Layout] need of a device's value: the fields they use, each
// checked for where it is used. It decodes values (see [Schema.Append]) into [Values], which the
// layout renders without parsing anything again. A Schema is immutable and safe for concurrent use.
//
// A value is either JSON or plain. A value whose first byte is '{' is JSON: it must be one
// object; its fields the templates use are taken by name (exactly, case and all), the others
// ignored. A string is used as it is; an integer (no fraction, no exponent) as written, "-0" as
// "0"; true and false as those words; null as no field at all. An object, an array or another
// number is refused where it is used: placeholder names hold no dots, so there are no nested
// paths. Any other value is plain: it is the value of {group}, exactly as before values could be
// JSON, and every other field is missing.
type Schema struct {
	fields []Field
	group  int // index of the field "group", or -1
	// runs are the parts of the templates that depend on the value alone: fields and the
	// literal text between them, between two placeholders of In. Append renders each one after
	// the fields, so that rendering a message appends one piece per run (see Layout.compile).
	runs [][]op
}

// GroupSchema is the schema of the default templates: {group}, one subject token.
var GroupSchema = &Schema{fields: []Field{{Name: group, Subject: true}}, group: 0}

// Fields returns the fields a value must have, in the order [Values] holds them: the out
// template's first, then the headers'. The slice is a copy the caller may keep.
func (s *Schema) Fields() []Field {
	out := make([]Field, len(s.fields))
	for i, f := range s.fields {
		f.Headers = append([]string(nil), f.Headers...)
		out[i] = f
	}
	return out
}

// Len returns the number of fields.
func (s *Schema) Len() int { return len(s.fields) }

// Index returns the index of field name in [Values], or -1 when the templates do not use it.
func (s *Schema) Index(name string) int {
	for i, f := range s.fields {
		if f.Name == name {
			return i
		}
	}
	return -1
}

// Group returns the index of {group} in [Values], or -1 when the templates do not use it.
func (s *Schema) Group() int { return s.group }

// Names returns the field names, in order.
func (s *Schema) Names() []string {
	out := make([]string, len(s.fields))
	for i, f := range s.fields {
		out[i] = f.Name
	}
	return out
}

// Values are the decoded fields of one device's value that a [Schema] needs, in its order, each
// one checked for where the templates use it, followed by the parts of the templates that depend
// on the value alone, rendered. A Values is an immutable string: copy it freely, compare it
// with ==, use its bytes as a map key ([Values.String], [ValuesOf]). The zero Values has no
// field.
//
// Its form, which [Schema.Append] writes: one byte, the number of entries n (the high bit set
// when offsets take two bytes), then n (start, end) offset pairs from the form's start, one byte
// each while the whole form is under 256 bytes, else two (little-endian), then the bytes. A
// field rendered inside a part is not stored twice: its entry points into the part.
type Values struct{ s string }

// ValuesOf returns the Values whose form is s, as [Values.String] returned it.
func ValuesOf(s string) Values { return Values{s} }

// String returns v's form.
func (v Values) String() string { return v.s }

// Len returns the number of entries v holds: the schema's fields, then its rendered parts.
func (v Values) Len() int {
	if v.s == "" {
		return 0
	}
	return int(v.s[0] & 0x7f)
}

// Get returns entry i, a substring of v; "" when v has no entry i.
func (v Values) Get(i int) string {
	if r, ok := get1(v.s, i); ok {
		return r
	}
	return v.getWide(i)
}

// get1 is Get for a form with one-byte offsets; false for another form, or no entry i. Small
// enough to inline: the hot path.
func get1(s string, i int) (string, bool) {
	if uint(2+2*i) < uint(len(s)) && s[0] < 0x80 && uint(i) < uint(s[0]) {
		return s[s[1+2*i]:s[2+2*i]], true
	}
	return "", false
}

func (v Values) getWide(i int) string {
	s := v.s
	if len(s) == 0 || s[0] < 0x80 || uint(i) >= uint(s[0]&0x7f) {
		return ""
	}
	o := 1 + 4*i
	return s[int(s[o])|int(s[o+1])<<8 : int(s[o+2])|int(s[o+3])<<8]
}

// PackValues returns the Values holding fields, in order. It checks nothing: it is for callers
// whose fields are checked already (tests, and tables decoded elsewhere).
func PackValues(fields ...string) Values {
	var b []byte
	spans := make([]span, len(fields))
	for i, f := range fields {
		spans[i] = span{len(b), len(b) + len(f)}
		b = append(b, f...)
	}
	out, err := appendForm(nil, b, spans)
	if err != nil {
		return Values{}
	}
	return Values{string(out)}
}

// appendForm appends the Values form of entries, each a span of body, to dst.
func appendForm(dst, body []byte, entries []span) ([]byte, error) {
	n := len(entries)
	wide, head := byte(0), 1+2*n
	if head+len(body) > 0xff {
		wide, head = 0x80, 1+4*n
	}
	if head+len(body) > 0xffff {
		return dst, errors.New("the fields the templates use are longer than 64 KiB together")
	}
	dst = append(dst, byte(n)|wide)
	for _, e := range entries {
		a, b := head+e.start, head+e.end
		if wide == 0 {
			dst = append(dst, byte(a), byte(b))
		} else {
			dst = append(dst, byte(a), byte(a>>8), byte(b), byte(b>>8))
		}
	}
	return append(dst, body...), nil
}

// Decode is [Schema.Append] into a new Values.
func (s *Schema) Decode(value []byte) (Values, error) {
	b, err := s.Append(nil, value)
	if err != nil {
		return Values{}, err
	}
	return Values{string(b)}, nil
}

// maxEntries bounds the entries of one Values: MaxFields fields and the rendered parts of the
// out template (at most one more than the placeholders of In) and of MaxHeaders headers.
const maxEntries = MaxFields + MaxPlaceholders + 1 + MaxHeaders

// Append decodes value (see [Schema] for the rules), checks every field the templates use for
// where they use it, and appends the [Values] form to dst: the fields, then the parts of the
// templates that depend on the value alone, rendered (the layout renders a message from them).
// The caller turns the appended bytes into a Values with [ValuesOf] (or looks them up as a map
// key first, without allocating). The error is a *[ValueError]; dst is then returned unchanged.
// Append never panics, whatever value holds, and allocates only for a JSON string with escapes,
// or to report an error.
func (s *Schema) Append(dst, value []byte) ([]byte, error) {
	base := len(dst)
	var fields [MaxFields]span // where each field's bytes are in dst
	var err error
	if len(value) > 0 && value[0] == '{' {
		dst, err = s.appendJSON(dst, value, &fields)
	} else {
		dst, err = s.appendPlain(dst, value, &fields)
	}
	if err != nil {
		return dst[:base], err
	}
	// The rendered parts, after the fields; a field a part holds is found there, not stored
	// again. Entries are spans of the body: the parts, then the fields no part holds.
	var entries [maxEntries]span
	nf := len(s.fields)
	body := len(dst)
	inPart := [MaxFields]bool{}
	for r, run := range s.runs {
		start := len(dst) - body
		for _, o := range run {
			if o.kind == opLit {
				dst = append(dst, o.text...)
				continue
			}
			f := fields[o.idx]
			at := len(dst) - body
			dst = append(dst, dst[f.start:f.end]...)
			if !inPart[o.idx] {
				inPart[o.idx], entries[o.idx] = true, span{at, len(dst) - body}
			}
		}
		entries[nf+r] = span{start, len(dst) - body}
	}
	for i := range nf {
		if !inPart[i] {
			f := fields[i]
			at := len(dst) - body
			dst = append(dst, dst[f.start:f.end]...)
			entries[i] = span{at, len(dst) - body}
		}
	}
	form := len(dst)
	dst, err = appendForm(dst, dst[body:form], entries[:nf+len(s.runs)])
	if err != nil {
		return dst[:base], &ValueError{Field: s.fields[0].Name, Err: ErrInvalidField, Detail: err.Error()}
	}
	n := copy(dst[base:], dst[form:])
	return dst[:base+n], nil
}

func (s *Schema) appendPlain(dst, value []byte, fields *[MaxFields]span) ([]byte, error) {
	for i, f := range s.fields {
		if i == s.group {
			continue
		}
		return dst, &ValueError{Field: f.Name, Err: ErrMissingField,
			Detail: fmt.Sprintf("the value is not a JSON object, so it is {group} alone; it has no field %q, %s", f.Name, f.which())}
	}
	if s.group < 0 {
		return dst, nil
	}
	if err := s.check(s.fields[s.group], view(value)); err != nil {
		return dst, &ValueError{Err: ErrInvalidToken, Detail: "the value is {group}, and " + strings.TrimPrefix(err.Error(), ErrInvalidToken.Error()+": ")}
	}
	fields[s.group] = span{len(dst), len(dst) + len(value)}
	return append(dst, value...), nil
}

// check reports why v cannot be used where the templates use f, or nil.
func (s *Schema) check(f Field, v string) error {
	if f.Subject {
		return ValidToken(v)
	}
	return validHeaderValue(v)
}

// validHeaderValue reports why v cannot be the value of a header, or a part of one: it must be
// non-empty, at most MaxFieldLen bytes of valid UTF-8 with no control character (no line breaks,
// which would end the header) and no white space at either end (which NATS clients trim).
func validHeaderValue(v string) error {
	switch {
	case v == "":
		return errors.New("empty")
	case len(v) > MaxFieldLen:
		return fmt.Errorf("longer than %d bytes (%d)", MaxFieldLen, len(v))
	}
	for i, r := range v {
		switch {
		case r == utf8.RuneError && isInvalidAt(v, i):
			return fmt.Errorf("%q is not valid UTF-8 at byte %d", v, i)
		case unicode.IsControl(r):
			return fmt.Errorf("%q contains a control character at byte %d", v, i)
		}
	}
	first, _ := utf8.DecodeRuneInString(v)
	last, _ := utf8.DecodeLastRuneInString(v)
	if unicode.IsSpace(first) || unicode.IsSpace(last) {
		return fmt.Errorf("%q starts or ends with white space", v)
	}
	return nil
}

// view returns b's bytes as a string without copying them, for checks that keep no reference to
// it once they return (their errors quote it into a string of their own).
func view(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

// Describe says, in one line for people, what a device's value must hold for these templates:
// which fields, each one where it is used.
func (s *Schema) Describe() string {
	if len(s.fields) == 0 {
		return "the templates use no field of the value: any value maps its device (one starting with '{' must be valid JSON)"
	}
	if len(s.fields) == 1 && s.group == 0 {
		return `a group (one subject token), or a JSON object whose "group" is one`
	}
	parts := make([]string, len(s.fields))
	for i, f := range s.fields {
		kind := "a header value"
		if f.Subject {
			kind = "a subject token"
		}
		parts[i] = fmt.Sprintf("%q (%s: %s)", f.Name, kind, f.where())
	}
	return "a JSON object with " + strings.Join(parts, ", ") + "; other fields are ignored"
}

// Example returns a value these templates can use, for people to start from: "group-a" when
// the templates use {group} alone, else a JSON object with a made-up value for every field.
func (s *Schema) Example() string {
	if len(s.fields) == 1 && s.group == 0 {
		return "group-a"
	}
	parts := make([]string, len(s.fields))
	for i, f := range s.fields {
		parts[i] = fmt.Sprintf("%q:%q", f.Name, strings.ReplaceAll(f.Name, "_", "-")+"-a")
	}
	return "{" + strings.Join(parts, ",") + "}"
}
