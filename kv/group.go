package kv

import (
	"unicode"
	"unicode/utf8"
)

// maxGroupLen is the longest group value accepted, in bytes.
const maxGroupLen = 255

// trimNewlines removes trailing "\n" and "\r\n" sequences, which `nats kv put` and shell pipes
// leave behind. Other white space is kept so that validGroup rejects it.
func trimNewlines(b []byte) []byte {
	for len(b) > 0 && b[len(b)-1] == '\n' {
		b = b[:len(b)-1]
		if len(b) > 0 && b[len(b)-1] == '\r' {
			b = b[:len(b)-1]
		}
	}
	return b
}

// validGroup reports whether s can be used as one subject token: non-empty, at most 255 bytes,
// valid UTF-8, without '.', '*', '>', white space or control characters.
func validGroup(s string) bool {
	if len(s) == 0 || len(s) > maxGroupLen {
		return false
	}
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c <= ' ' || c == 0x7f || c == '.' || c == '*' || c == '>' {
				return false
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			return false
		}
		if unicode.IsSpace(r) || unicode.IsControl(r) {
			return false
		}
		i += size
	}
	return true
}
