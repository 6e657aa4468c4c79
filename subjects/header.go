package subjects

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxHeaders is the largest number of output headers a [Layout] may have.
const MaxHeaders = 16

// reservedHeaderPrefixes are the header names NATS and kvmapper give a meaning of their own:
// an output header may not take one.
var reservedHeaderPrefixes = []string{"nats-", "kvmapper-"}

// header is one output header: its name and its value template, compiled.
type header struct {
	spec  string  // as given: Name=template
	name  string  // the header's name
	parts []token // literal text (any, with its dots) and whole placeholders, in order
	names []string
	ops   []op // a step per field
	fast  []op // a step per part the value renders alone (see Layout.outFast)
	// one and fastOne say whether ops and fast are one field alone, or literal text alone (lit):
	// see [Layout.HeaderString].
	one, fastOne int
	lit          string
}

// parseHeader parses an output header given as Name=template, e.g. "Tenant={tenant}" or
// "Site={region}/{site}": the name before the first '=', the value template after it. The name is
// printable ASCII without ':' (what NATS allows in a header name), and starts neither with
// "Nats-" nor with "KVMapper-" (in any case). The template is literal text with {name}
// placeholders (name matching [a-z][a-z0-9_]*); its literal text holds no control character, no
// '{' or '}' outside a placeholder, and it neither starts nor ends with white space.
func parseHeader(spec string) (*header, error) {
	name, tpl, ok := strings.Cut(spec, "=")
	if !ok {
		return nil, fmt.Errorf("%w: header %q: write Name={field}, e.g. Tenant={tenant}", ErrInvalidTemplate, spec)
	}
	if err := validHeaderName(name); err != nil {
		return nil, fmt.Errorf("%w: header %q: %v", ErrInvalidTemplate, spec, err)
	}
	h := &header{spec: spec, name: name}
	if tpl == "" {
		return nil, fmt.Errorf("%w: header %q: the value template is empty; write Name={field}", ErrInvalidTemplate, spec)
	}
	first, _ := utf8.DecodeRuneInString(tpl)
	last, _ := utf8.DecodeLastRuneInString(tpl)
	if unicode.IsSpace(first) || unicode.IsSpace(last) {
		return nil, fmt.Errorf("%w: header %q: the value template starts or ends with white space, which NATS clients trim", ErrInvalidTemplate, spec)
	}
	seen := map[string]bool{}
	rest := tpl
	for rest != "" {
		open := strings.IndexAny(rest, "{}")
		if open < 0 {
			open = len(rest)
		}
		if lit := rest[:open]; lit != "" {
			if err := validLiteral(lit); err != nil {
				return nil, fmt.Errorf("%w: header %q: %v", ErrInvalidTemplate, spec, err)
			}
			h.parts = append(h.parts, token{text: lit})
		}
		rest = rest[open:]
		if rest == "" {
			break
		}
		end := strings.IndexByte(rest, '}')
		if rest[0] == '}' || end < 0 {
			return nil, fmt.Errorf("%w: header %q: unmatched %q; braces only enclose a placeholder such as {tenant}", ErrInvalidTemplate, spec, rest[:1])
		}
		ph := rest[1:end]
		if !validName(ph) {
			return nil, fmt.Errorf("%w: header %q: %q is not a placeholder; use {name} with name matching [a-z][a-z0-9_]*", ErrInvalidTemplate, spec, rest[:end+1])
		}
		h.parts = append(h.parts, token{text: ph, ph: true})
		if !seen[ph] {
			seen[ph] = true
			h.names = append(h.names, ph)
		}
		rest = rest[end+1:]
	}
	return h, nil
}

func validHeaderName(name string) error {
	if name == "" {
		return fmt.Errorf("the name is empty")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 33 || c > 126 || c == ':' {
			return fmt.Errorf("the name %q holds %q; use printable ASCII without ':' or white space", name, rune(c))
		}
	}
	lower := strings.ToLower(name)
	for _, p := range reservedHeaderPrefixes {
		if strings.HasPrefix(lower, p) {
			return fmt.Errorf("the name %q starts with %q, which NATS and kvmapper keep for their own headers", name, name[:len(p)])
		}
	}
	return nil
}

func validLiteral(lit string) error {
	for i, r := range lit {
		switch {
		case r == utf8.RuneError && isInvalidAt(lit, i):
			return fmt.Errorf("the template is not valid UTF-8 at %q", lit)
		case unicode.IsControl(r):
			return fmt.Errorf("the template holds a control character in %q", lit)
		}
	}
	return nil
}

// WithHeaders returns a copy of l whose mapped messages also carry the output headers specs, each
// given as Name=template (see the rules below): `--header 'Tenant={tenant}'`. A placeholder of a
// header template is a placeholder of In ({device}, {event}) or a field of the device's value,
// as in Out; {partition} is refused. Header names must differ from each other in any case. A
// mapped message's header of the same name, in any case, is replaced. The error wraps
// [ErrInvalidTemplate] and says what to change.
//
// A header name is printable ASCII without ':' (what NATS allows), and starts neither with
// "Nats-" nor "KVMapper-". A template is literal text and {name} placeholders; its literal text
// holds no control character and no brace, and it neither starts nor ends with white space.
func (l *Layout) WithHeaders(specs []string) (*Layout, error) {
	if len(specs) > MaxHeaders {
		return nil, fmt.Errorf("%w: %d headers; use at most %d", ErrInvalidTemplate, len(specs), MaxHeaders)
	}
	c := *l
	c.headers = nil
	for _, spec := range specs {
		h, err := parseHeader(spec)
		if err != nil {
			return nil, err
		}
		for _, o := range c.headers {
			if strings.EqualFold(o.name, h.name) {
				return nil, fmt.Errorf("%w: headers %q and %q have the same name; give each header once", ErrInvalidTemplate, o.spec, h.spec)
			}
		}
		for _, name := range h.names {
			if name == partition {
				return nil, fmt.Errorf("%w: header %q may not use {partition}: the KVMapper-Prov header carries it", ErrInvalidTemplate, spec)
			}
		}
		c.headers = append(c.headers, h)
	}
	if err := c.compile(); err != nil {
		return nil, err
	}
	return &c, nil
}

// Headers returns the output headers as they were given, Name=template.
func (l *Layout) Headers() []string {
	out := make([]string, len(l.headers))
	for i, h := range l.headers {
		out[i] = h.spec
	}
	return out
}

// NumHeaders returns the number of output headers.
func (l *Layout) NumHeaders() int { return len(l.headers) }

// HeaderName returns the name of output header i, 0 ≤ i < [Layout.NumHeaders].
func (l *Layout) HeaderName(i int) string { return l.headers[i].name }

// AppendHeader appends the value of output header i for f and v to dst and returns the extended
// slice. It does not allocate when dst has room. f must have been filled by l.Parse and v decoded
// by l.Schema(); the value is then one a NATS header carries unchanged.
func (l *Layout) AppendHeader(dst []byte, i int, f *Fields, v Values) []byte {
	h := l.headers[i]
	if v.Len() == l.fastLen {
		return l.appendOps(dst, h.fast, f, v)
	}
	return l.appendOps(dst, h.ops, f, v)
}

// HeaderString returns the value of output header i for v when it takes no rendering per message
// (the template is one field of the value, or literal text alone, or the value rendered it when
// it was decoded), and true; it returns false when the header needs [Layout.AppendHeader]. The
// string is a part of v, or of l: it does not change, and costs nothing to keep.
func (l *Layout) HeaderString(i int, v Values) (string, bool) {
	h := l.headers[i]
	one := h.one
	if v.Len() == l.fastLen {
		one = h.fastOne
	}
	switch {
	case one >= 0:
		if r, ok := get1(v.s, one); ok {
			return r, true
		}
		return v.Get(one), true
	case one == oneLiteral:
		return h.lit, true
	}
	return "", false
}

// oneOf describes ops of a header for HeaderString: the index of its one field, oneLiteral when
// it is literal text alone (lit), or oneNone.
func oneOf(ops []op) (one int, lit string) {
	if len(ops) == 1 {
		switch ops[0].kind {
		case opValue:
			return ops[0].idx, ""
		case opLit:
			return oneLiteral, ops[0].text
		}
	}
	return oneNone, ""
}

const (
	oneLiteral = -1
	oneNone    = -2
)

// IsHeader reports whether key names one of the output headers, in any case: a mapped message's
// header of that name is replaced by the output header.
func (l *Layout) IsHeader(key string) bool {
	for _, h := range l.headers {
		if len(h.name) == len(key) && strings.EqualFold(h.name, key) {
			return true
		}
	}
	return false
}
