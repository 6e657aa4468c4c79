package subjects

import (
	"fmt"
	"strings"
)

// token is one dot-separated token of a template: a literal, or the placeholder name when ph is set.
type token struct {
	text string
	ph   bool
}

// Template is an immutable parsed subject template: dot-separated tokens, each either a literal or a
// whole-token placeholder {name} where name matches [a-z][a-z0-9_]*. A placeholder may appear more
// than once; [NewLayout] adds the rules a kvmapper layout needs. Template is safe for concurrent use.
type Template struct {
	s      string
	tokens []token
	names  []string // distinct placeholder names in order of first appearance
}

// ParseTemplate parses s, for example "outgoing.{group}.{device}.{event}". Literal tokens must be
// valid subject tokens (see [ValidToken]) and may not contain '{' or '}'. The error wraps
// [ErrInvalidTemplate] and says which token is wrong.
func ParseTemplate(s string) (*Template, error) {
	if s == "" {
		return nil, fmt.Errorf("%w: empty template; write dot-separated tokens such as incoming.{device}.{event}", ErrInvalidTemplate)
	}
	t := &Template{s: s}
	seen := make(map[string]bool)
	for i, text := range strings.Split(s, ".") {
		if strings.HasPrefix(text, "{") && strings.HasSuffix(text, "}") && len(text) >= 2 {
			name := text[1 : len(text)-1]
			if !validName(name) {
				return nil, fmt.Errorf("%w: %q: token %d %q is not a placeholder name; use {name} with name matching [a-z][a-z0-9_]*",
					ErrInvalidTemplate, s, i+1, text)
			}
			t.tokens = append(t.tokens, token{text: name, ph: true})
			if !seen[name] {
				seen[name] = true
				t.names = append(t.names, name)
			}
			continue
		}
		if strings.ContainsAny(text, "{}") {
			return nil, fmt.Errorf("%w: %q: token %d %q mixes a placeholder with literal text; a placeholder must be a whole token like {device}",
				ErrInvalidTemplate, s, i+1, text)
		}
		if err := ValidToken(text); err != nil {
			return nil, fmt.Errorf("%w: %q: token %d: %w", ErrInvalidTemplate, s, i+1, err)
		}
		t.tokens = append(t.tokens, token{text: text})
	}
	return t, nil
}

func validName(name string) bool {
	if name == "" || name[0] < 'a' || name[0] > 'z' {
		return false
	}
	for i := 1; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// String returns the template as it was parsed.
func (t *Template) String() string { return t.s }

// Placeholders returns the distinct placeholder names in order of first appearance. The slice is a
// copy the caller may keep.
func (t *Template) Placeholders() []string { return append([]string(nil), t.names...) }

// has reports whether the template contains the placeholder name.
func (t *Template) has(name string) bool {
	for _, n := range t.names {
		if n == name {
			return true
		}
	}
	return false
}

// count returns how many times the placeholder name appears.
func (t *Template) count(name string) int {
	n := 0
	for _, tk := range t.tokens {
		if tk.ph && tk.text == name {
			n++
		}
	}
	return n
}

// leading returns the number of literal tokens before the first placeholder.
func (t *Template) leading() int {
	for i, tk := range t.tokens {
		if tk.ph {
			return i
		}
	}
	return len(t.tokens)
}

// Render returns the subject with every placeholder replaced by its value. Each value must pass
// [ValidToken]; a missing or invalid value yields an error wrapping [ErrInvalidToken]. Extra
// entries in values are ignored. Render allocates; the hot path uses [Layout.AppendOut].
func (t *Template) Render(values map[string]string) (string, error) {
	return t.render(func(name string) (string, error) {
		v, ok := values[name]
		if !ok {
			return "", fmt.Errorf("%w: no value for {%s} in %q", ErrInvalidToken, name, t.s)
		}
		if err := ValidToken(v); err != nil {
			return "", fmt.Errorf("rendering {%s} of %q: %w", name, t.s, err)
		}
		return v, nil
	})
}

func (t *Template) render(value func(name string) (string, error)) (string, error) {
	var b strings.Builder
	for i, tk := range t.tokens {
		if i > 0 {
			b.WriteByte('.')
		}
		if !tk.ph {
			b.WriteString(tk.text)
			continue
		}
		v, err := value(tk.text)
		if err != nil {
			return "", err
		}
		b.WriteString(v)
	}
	return b.String(), nil
}

// Match is the inverse of [Template.Render]: it returns the placeholder values of subject, and
// false when subject does not have the template's shape, a value fails [ValidToken], or a repeated
// placeholder has different values.
func (t *Template) Match(subject string) (map[string]string, bool) {
	values := make(map[string]string, len(t.names))
	rest := subject
	for i, tk := range t.tokens {
		var tok string
		if i == len(t.tokens)-1 {
			tok, rest = rest, ""
			if strings.IndexByte(tok, '.') >= 0 {
				return nil, false
			}
		} else {
			var ok bool
			if tok, rest, ok = strings.Cut(rest, "."); !ok {
				return nil, false
			}
		}
		if !tk.ph {
			if tok != tk.text {
				return nil, false
			}
			continue
		}
		if ValidToken(tok) != nil {
			return nil, false
		}
		if prev, ok := values[tk.text]; ok && prev != tok {
			return nil, false
		}
		values[tk.text] = tok
	}
	return values, true
}

// Wildcard returns the template with every placeholder replaced by "*", e.g. "incoming.*.*".
func (t *Template) Wildcard() string {
	s, _ := t.render(func(string) (string, error) { return "*", nil })
	return s
}

// Prefix returns the literal tokens before the first placeholder, joined with '.', e.g. "incoming".
// It is empty when the template starts with a placeholder.
func (t *Template) Prefix() string {
	parts := make([]string, 0, t.leading())
	for _, tk := range t.tokens[:t.leading()] {
		parts = append(parts, tk.text)
	}
	return strings.Join(parts, ".")
}
