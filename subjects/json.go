package subjects

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// span of a field's JSON value in the value being decoded; end 0 means not found.
type jsonSpan struct{ start, end int }

func (s *Schema) appendJSON(dst, value []byte, fields *[MaxFields]span) ([]byte, error) {
	if !json.Valid(value) {
		return dst, &ValueError{Err: ErrInvalidValue, Detail: "the value starts with '{' but is not valid JSON: " + syntaxError(value)}
	}
	var found [MaxFields]jsonSpan
	i := skipSpace(value, 1)
	for value[i] != '}' {
		ks := i
		i = skipString(value, i)
		key := value[ks+1 : i-1]
		i = skipSpace(value, i)
		i = skipSpace(value, i+1) // the colon
		vs := i
		i = skipValue(value, i)
		if idx := s.keyIndex(key); idx >= 0 {
			if found[idx].end != 0 {
				return dst, &ValueError{Field: s.fields[idx].Name, Err: ErrInvalidValue,
					Detail: fmt.Sprintf("field %q appears twice in the value", s.fields[idx].Name)}
			}
			found[idx] = jsonSpan{vs, i}
		}
		i = skipSpace(value, i)
		if value[i] == ',' {
			i = skipSpace(value, i+1)
		}
	}
	for idx, f := range s.fields {
		sp := found[idx]
		raw := value[sp.start:sp.end]
		if sp.end == 0 || string(raw) == "null" {
			return dst, &ValueError{Field: f.Name, Err: ErrMissingField,
				Detail: fmt.Sprintf("the value has no field %q, %s", f.Name, f.which())}
		}
		start := len(dst)
		var bad string
		switch c := raw[0]; {
		case c == '"':
			if bytes.IndexByte(raw, '\\') < 0 {
				dst = append(dst, raw[1:len(raw)-1]...)
				break
			}
			var v string
			if err := json.Unmarshal(raw, &v); err != nil {
				return dst, &ValueError{Field: f.Name, Err: ErrInvalidValue, Detail: fmt.Sprintf("field %q: %v", f.Name, err)}
			}
			dst = append(dst, v...)
		case c == 't' || c == 'f':
			dst = append(dst, raw...)
		case c == '{':
			bad = "is an object; nested values are not used: give the templates a field of its own, e.g. \"site_floor\""
		case c == '[':
			bad = "is an array; arrays are not used: give the templates a field of its own"
		default: // a number
			if bytes.ContainsAny(raw, ".eE") {
				bad = fmt.Sprintf("is the number %s; only integers are used: write it as a string to use it as it is", raw)
				break
			}
			if string(raw) == "-0" {
				raw = raw[1:]
			}
			dst = append(dst, raw...)
		}
		if bad == "" {
			if err := s.check(f, view(dst[start:])); err != nil {
				bad = strings.TrimPrefix(err.Error(), ErrInvalidToken.Error()+": ")
			}
		}
		if bad != "" {
			return dst, &ValueError{Field: f.Name, Err: ErrInvalidField,
				Detail: fmt.Sprintf("field %q, %s: %s", f.Name, f.which(), bad)}
		}
		fields[idx] = span{start, len(dst)}
	}
	return dst, nil
}

// keyIndex returns the index of the field whose name is the JSON string body key, or -1.
func (s *Schema) keyIndex(key []byte) int {
	if bytes.IndexByte(key, '\\') >= 0 {
		var k string
		if json.Unmarshal(append(append([]byte{'"'}, key...), '"'), &k) != nil {
			return -1
		}
		key = []byte(k)
	}
	for i, f := range s.fields {
		if string(key) == f.Name {
			return i
		}
	}
	return -1
}

// syntaxError says where value stops being JSON; value is known to be invalid.
func syntaxError(value []byte) string {
	var v any
	err := json.Unmarshal(value, &v)
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Sprintf("%v (at byte %d)", se, se.Offset)
	}
	if err != nil {
		return err.Error()
	}
	return "not one object"
}

// The scanners below read JSON that json.Valid accepted: they never check syntax and never run
// past the end of it.

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index after the string starting at b[i] == '"'.
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return i
}

// skipValue returns the index after the value starting at b[i].
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				i = skipString(b, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
		}
		return i
	}
	for i < len(b) {
		switch b[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
		i++
	}
	return i
}
