package subjects

import (
	"fmt"
	"unicode"
	"unicode/utf8"
)

// MaxTokenLen is the longest token, in bytes, that [ValidToken] accepts.
const MaxTokenLen = 255

// ValidToken reports whether s can be used as one subject token, for example a group read from KV:
// non-empty, at most [MaxTokenLen] bytes, valid UTF-8, and free of '.', '*', '>', white space
// ([unicode.IsSpace]) and control characters. It returns nil, or an error wrapping [ErrInvalidToken]
// that says why. A value that passes can never add tokens or wildcards to a subject. It is safe for
// concurrent use.
func ValidToken(s string) error {
	if IsValidToken(s) {
		return nil
	}
	if s == "" {
		return fmt.Errorf("%w: empty", ErrInvalidToken)
	}
	if len(s) > MaxTokenLen {
		return fmt.Errorf("%w: longer than %d bytes (%d)", ErrInvalidToken, MaxTokenLen, len(s))
	}
	for i, r := range s {
		switch {
		case r == utf8.RuneError && isInvalidAt(s, i):
			return fmt.Errorf("%w: %q is not valid UTF-8 at byte %d", ErrInvalidToken, s, i)
		case r == '.' || r == '*' || r == '>':
			return fmt.Errorf("%w: %q contains '%c'", ErrInvalidToken, s, r)
		case unicode.IsSpace(r):
			return fmt.Errorf("%w: %q contains white space at byte %d", ErrInvalidToken, s, i)
		case unicode.IsControl(r):
			return fmt.Errorf("%w: %q contains a control character at byte %d", ErrInvalidToken, s, i)
		}
	}
	return fmt.Errorf("%w: %q", ErrInvalidToken, s) // IsValidToken refused it; unreachable by FuzzIsValidToken
}

// isInvalidAt tells a decoding error from a literal U+FFFD, which is valid UTF-8.
func isInvalidAt(s string, i int) bool {
	_, size := utf8.DecodeRuneInString(s[i:])
	return size <= 1
}

// IsValidToken reports whether [ValidToken] accepts s, without allocating: the check the
// groups table makes on every value.
func IsValidToken(s string) bool {
	if len(s) == 0 || len(s) > MaxTokenLen {
		return false
	}
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			// ASCII: white space and control characters are all at or below ' ', or DEL.
			if c <= ' ' || c == 0x7f || c == '.' || c == '*' || c == '>' {
				return false
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && size == 1) || unicode.IsSpace(r) || unicode.IsControl(r) {
			return false
		}
		i += size
	}
	return true
}
