package subjects

import (
	"fmt"
	"strconv"
	"strings"
)

// MaxPlaceholders is the largest number of placeholders the in template may have: [Fields] holds
// their spans in a fixed-size array so that parsing never allocates.
const MaxPlaceholders = 8

// MaxPartitions is the largest partition count [NewLayout] accepts.
const MaxPartitions = 1024

// Placeholder names with a meaning of their own.
const (
	device    = "device"
	group     = "group"
	partition = "partition"
)

// malformedToken replaces every placeholder in [Layout.MalformedSubject].
const malformedToken = "_malformed"

// opKind says what one step of a precomputed render appends.
type opKind uint8

const (
	opLit   opKind = iota // text, dots included
	opValue               // field idx of the device's Values
	opField               // the span of in placeholder idx
)

type op struct {
	kind opKind
	text string
	idx  int
}

// Layout ties together the in, out and unmapped templates and the partition count, and holds what
// the hot path needs precomputed. Build it with [NewLayout]; it is immutable (do not assign its
// exported fields, which the precomputed ones derive from) and safe for concurrent use.
type Layout struct {
	In, Out, Unmapped *Template
	Partitions        int

	inPrefixDot string  // "incoming.": the leading literal tokens of In and their trailing dot
	inRest      []token // In's tokens after the leading literals; placeholders in order
	devIdx      int     // index of {device} among In's placeholders
	outOps      []op    // Out, a step per field: what Values without rendered parts render with
	outFast     []op    // Out, a step per part of it the value renders alone (see Schema.runs)
	// fastLen is the number of entries of the Values the schema decodes, which hold the rendered
	// parts the fast steps use; -1 when there are none (then the two are the same).
	fastLen     int
	unmappedOps []op
	headers     []*header // the output headers (see [Layout.WithHeaders])
	schema      *Schema
	malformed   string
	storedShape string // "incoming.<partition>.{device}.{event}", for errors
}

// NewLayout parses and checks the three templates and the partition count. The error wraps
// [ErrInvalidTemplate] and says what to change. The rules:
//   - in starts with a literal token, contains {device} exactly once and every other placeholder at
//     most once, no {group} or {partition}, and at most [MaxPlaceholders] placeholders;
//   - out starts with a literal token and contains {device}, and no {partition}; each of its other
//     placeholders is one of in, or else a field of the device's value ({group}, {region}, …:
//     see [Schema]);
//   - unmapped starts with a literal token and has at least one placeholder, all of which appear in
//     in; no {group};
//   - partitions is between 1 and [MaxPartitions];
//   - the subjects of the INCOMING, OUTGOING and UNMAPPED streams do not overlap, so that a
//     republished message can never be captured again.
func NewLayout(in, out, unmapped string, partitions int) (*Layout, error) {
	l := &Layout{Partitions: partitions}
	var err error
	if l.In, err = ParseTemplate(in); err != nil {
		return nil, fmt.Errorf("in template: %w", err)
	}
	if l.Out, err = ParseTemplate(out); err != nil {
		return nil, fmt.Errorf("out template: %w", err)
	}
	if l.Unmapped, err = ParseTemplate(unmapped); err != nil {
		return nil, fmt.Errorf("unmapped template: %w", err)
	}
	if partitions < 1 || partitions > MaxPartitions {
		return nil, fmt.Errorf("%w: %d partitions; use between 1 and %d", ErrInvalidTemplate, partitions, MaxPartitions)
	}
	if err := l.checkIn(); err != nil {
		return nil, err
	}
	if err := l.checkOut(); err != nil {
		return nil, err
	}
	if err := l.checkUnmapped(); err != nil {
		return nil, err
	}
	if err := l.checkOverlap(); err != nil {
		return nil, err
	}
	l.precompute()
	if err := l.compile(); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *Layout) checkIn() error {
	t := l.In
	if t.leading() == 0 {
		return fmt.Errorf("%w: in %q must start with a literal token, e.g. incoming.{device}.{event}", ErrInvalidTemplate, t)
	}
	for _, name := range []string{group, partition} {
		if t.has(name) {
			return fmt.Errorf("%w: in %q may not contain {%s}: it is not part of what devices publish", ErrInvalidTemplate, t, name)
		}
	}
	if !t.has(device) {
		return fmt.Errorf("%w: in %q must contain {device}, e.g. incoming.{device}.{event}", ErrInvalidTemplate, t)
	}
	for _, name := range t.names {
		if n := t.count(name); n > 1 {
			return fmt.Errorf("%w: in %q contains {%s} %d times; each placeholder may appear once", ErrInvalidTemplate, t, name, n)
		}
	}
	if len(t.names) > MaxPlaceholders {
		return fmt.Errorf("%w: in %q has %d placeholders; use at most %d", ErrInvalidTemplate, t, len(t.names), MaxPlaceholders)
	}
	return nil
}

func (l *Layout) checkOut() error {
	t := l.Out
	if t.leading() == 0 {
		return fmt.Errorf("%w: out %q must start with a literal token, e.g. outgoing.{group}.{device}.{event}", ErrInvalidTemplate, t)
	}
	if !t.has(device) {
		return fmt.Errorf("%w: out %q must contain {device}, e.g. outgoing.{group}.{device}.{event}", ErrInvalidTemplate, t)
	}
	if t.has(partition) {
		return fmt.Errorf("%w: out %q may not contain {partition}: the KVMapper-Prov header carries it", ErrInvalidTemplate, t)
	}
	return nil
}

func (l *Layout) checkUnmapped() error {
	t := l.Unmapped
	if t.leading() == 0 {
		return fmt.Errorf("%w: unmapped %q must start with a literal token, e.g. unmapped.{device}.{event}", ErrInvalidTemplate, t)
	}
	if len(t.names) == 0 {
		// UNMAPPED captures prefix.>, which a subject with no token after the prefix would miss.
		return fmt.Errorf("%w: unmapped %q has no placeholder; add one, e.g. unmapped.{device}.{event}", ErrInvalidTemplate, t)
	}
	for _, name := range t.names {
		if name == group {
			return fmt.Errorf("%w: unmapped %q may not contain {group}: unmapped messages have none", ErrInvalidTemplate, t)
		}
		if !l.In.has(name) {
			return fmt.Errorf("%w: unmapped %q uses {%s}, which in %q does not have; use only placeholders of in",
				ErrInvalidTemplate, t, name, l.In)
		}
	}
	return nil
}

// checkOverlap refuses layouts where one stream would capture what kvmapper publishes to another:
// republishing into INCOMING would loop forever, and the server refuses overlapping streams.
func (l *Layout) checkOverlap() error {
	in := l.StreamSubject()
	stored := l.In.Prefix() + ".*." + strings.TrimPrefix(in, l.In.Prefix()+".")
	out, unm := l.OutStreamSubject(), l.UnmappedStreamSubject()
	for _, c := range []struct{ what, a, b string }{
		{"out", out, in}, {"out", out, stored}, {"unmapped", unm, in}, {"unmapped", unm, stored},
	} {
		if overlap(c.a, c.b) {
			return fmt.Errorf("%w: %s stream subject %q overlaps the INCOMING subjects %q, so republished messages would loop; give %s a different first token",
				ErrInvalidTemplate, c.what, c.a, c.b, c.what)
		}
	}
	if overlap(out, unm) {
		return fmt.Errorf("%w: out stream subject %q overlaps unmapped stream subject %q; give them different literal prefixes",
			ErrInvalidTemplate, out, unm)
	}
	return nil
}

// overlap reports whether some subject matches both patterns a and b ('*' and '>' wildcards).
func overlap(a, b string) bool {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(at) && i < len(bt); i++ {
		x, y := at[i], bt[i]
		if x == ">" || y == ">" {
			return true
		}
		if x != "*" && y != "*" && x != y {
			return false
		}
	}
	return len(at) == len(bt)
}

func (l *Layout) precompute() {
	lead := l.In.leading()
	l.inPrefixDot = l.In.Prefix() + "."
	l.inRest = l.In.tokens[lead:]
	for i, name := range l.In.names {
		if name == device {
			l.devIdx = i
		}
	}
	l.unmappedOps = l.ops(l.Unmapped.tokens, nil)
	l.malformed, _ = l.Unmapped.render(func(string) (string, error) { return malformedToken, nil })
	l.storedShape = l.inPrefixDot + "<partition>" + strings.TrimPrefix(l.In.String(), l.In.Prefix())
}

// compile derives the schema of the device's values from Out and the headers, and the steps that
// render them.
func (l *Layout) compile() error {
	sc := &Schema{group: -1}
	add := func(name string, subject bool, hdr string) error {
		if l.In.has(name) {
			return nil
		}
		i := sc.Index(name)
		if i < 0 {
			if len(sc.fields) == MaxFields {
				return fmt.Errorf("%w: the out and header templates use more than %d fields of the value", ErrInvalidTemplate, MaxFields)
			}
			i = len(sc.fields)
			sc.fields = append(sc.fields, Field{Name: name})
			if name == group {
				sc.group = i
			}
		}
		f := &sc.fields[i]
		f.Subject = f.Subject || subject
		if hdr != "" && (len(f.Headers) == 0 || f.Headers[len(f.Headers)-1] != hdr) {
			f.Headers = append(f.Headers, hdr)
		}
		return nil
	}
	for _, name := range l.Out.names {
		if err := add(name, true, ""); err != nil {
			return err
		}
	}
	for _, h := range l.headers {
		for _, name := range h.names {
			if err := add(name, false, h.name); err != nil {
				return err
			}
		}
	}
	l.outOps = l.ops(l.Out.tokens, sc)
	l.outFast = sc.addRuns(l.outOps)
	for _, h := range l.headers {
		h.ops = l.headerOps(h.parts, sc)
		h.fast = sc.addRuns(h.ops)
		h.one, h.lit = oneOf(h.ops)
		h.fastOne, _ = oneOf(h.fast)
	}
	l.schema = sc
	l.fastLen = -1
	if len(sc.runs) > 0 {
		l.fastLen = len(sc.fields) + len(sc.runs)
	}
	return nil
}

// addRuns returns ops with each stretch of literal text and fields between two placeholders of
// In that holds a field, and more than that field alone, replaced by one step: a part the
// schema renders once per value, when it decodes it (see [Schema.Append]). Rendering a message
// then appends one piece per part: "outgoing.eu.g7." rather than five.
func (sc *Schema) addRuns(ops []op) []op {
	var out, run []op
	flush := func() {
		values := 0
		for _, o := range run {
			if o.kind == opValue {
				values++
			}
		}
		switch {
		case values == 0 || len(run) == 1:
			out = append(out, run...)
		default:
			out = append(out, op{kind: opValue, idx: len(sc.fields) + len(sc.runs)})
			sc.runs = append(sc.runs, run)
		}
		run = nil
	}
	for _, o := range ops {
		if o.kind == opField {
			flush()
			out = append(out, o)
			continue
		}
		run = append(run, o)
	}
	flush()
	return out
}

// ops compiles tokens into steps, merging adjacent literals and dots so that rendering appends as
// few pieces as possible. Placeholders of In render their span, others their field of the
// device's values (sc).
func (l *Layout) ops(tokens []token, sc *Schema) []op {
	var b opBuilder
	for i, tk := range tokens {
		if i > 0 {
			b.lit.WriteByte('.')
		}
		b.add(l, tk, sc)
	}
	return b.done()
}

// headerOps is ops for a header template, whose parts are joined as they are.
func (l *Layout) headerOps(parts []token, sc *Schema) []op {
	var b opBuilder
	for _, tk := range parts {
		b.add(l, tk, sc)
	}
	return b.done()
}

type opBuilder struct {
	ops []op
	lit strings.Builder
}

func (b *opBuilder) flush() {
	if b.lit.Len() > 0 {
		b.ops = append(b.ops, op{kind: opLit, text: b.lit.String()})
		b.lit.Reset()
	}
}

func (b *opBuilder) add(l *Layout, tk token, sc *Schema) {
	switch {
	case !tk.ph:
		b.lit.WriteString(tk.text)
	case l.inIndex(tk.text) >= 0:
		b.flush()
		b.ops = append(b.ops, op{kind: opField, idx: l.inIndex(tk.text)})
	default:
		b.flush()
		b.ops = append(b.ops, op{kind: opValue, idx: sc.Index(tk.text)})
	}
}

func (b *opBuilder) done() []op {
	b.flush()
	return b.ops
}

// Schema returns what the out and header templates need of a device's value: the fields they
// use, besides the placeholders of In.
func (l *Layout) Schema() *Schema { return l.schema }

// inIndex returns the index of name among In's placeholders, or -1.
func (l *Layout) inIndex(name string) int {
	for i, n := range l.In.names {
		if n == name {
			return i
		}
	}
	return -1
}

// StreamSubject returns the subject the INCOMING stream captures: In with placeholders replaced by
// "*", e.g. "incoming.*.*".
func (l *Layout) StreamSubject() string { return l.In.Wildcard() }

// TransformSource returns the source of INCOMING's subject transform; it equals [Layout.StreamSubject].
func (l *Layout) TransformSource() string { return l.StreamSubject() }

// TransformDest returns the destination of INCOMING's subject transform: In with a partition token
// inserted after the leading literal tokens and each placeholder replaced by its wildcard, e.g.
// "incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}".
func (l *Layout) TransformDest() string {
	var b strings.Builder
	b.WriteString(l.inPrefixDot)
	fmt.Fprintf(&b, "{{partition(%d,%d)}}", l.Partitions, l.devIdx+1)
	wc := 0
	for _, tk := range l.inRest {
		b.WriteByte('.')
		if tk.ph {
			wc++
			fmt.Fprintf(&b, "{{wildcard(%d)}}", wc)
		} else {
			b.WriteString(tk.text)
		}
	}
	return b.String()
}

// MappingSource returns the source of the account subject mapping that fills the partition
// streams of the [PartitionStreams] layout: the subject devices publish to, e.g. "incoming.*.*".
// It equals [Layout.TransformSource]: the mapping does on publish what INCOMING's transform does
// on ingest in the [SingleStream] layout.
func (l *Layout) MappingSource() string { return l.TransformSource() }

// MappingDest returns the destination of that mapping, e.g.
// "incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}"; it equals [Layout.TransformDest].
func (l *Layout) MappingDest() string { return l.TransformDest() }

// Filter returns the consumer filter subject for partition p, e.g. "incoming.7.>": in the
// [PartitionStreams] layout, the subject partition p's stream captures.
func (l *Layout) Filter(p int) string { return l.inPrefixDot + strconv.Itoa(p) + ".>" }

// OutStreamSubject returns the subject the OUTGOING stream captures: Out's leading literal tokens
// followed by ".>", e.g. "outgoing.>".
func (l *Layout) OutStreamSubject() string { return l.Out.Prefix() + ".>" }

// UnmappedStreamSubject returns the subject the UNMAPPED stream captures, e.g. "unmapped.>".
func (l *Layout) UnmappedStreamSubject() string { return l.Unmapped.Prefix() + ".>" }

// MalformedSubject returns the subject where a message whose subject cannot be parsed is
// dead-lettered: Unmapped with every placeholder replaced by "_malformed", e.g.
// "unmapped._malformed._malformed".
func (l *Layout) MalformedSubject() string { return l.malformed }

// StoredSubject returns the subject the server stores for a message published to In rendered with
// values: the partition of values["device"] inserted after the leading literal tokens, e.g.
// "incoming.7.dev-42.temp". Errors are those of [Template.Render]. It is meant for tests and tools.
func (l *Layout) StoredSubject(values map[string]string) (string, error) {
	s, err := l.In.Render(values)
	if err != nil {
		return "", err
	}
	p := Partition(values[device], l.Partitions)
	return l.inPrefixDot + strconv.Itoa(p) + s[len(l.inPrefixDot)-1:], nil
}
