package kv

// trimNewlines removes trailing "\n" and "\r\n" sequences, which `nats kv put` and shell pipes
// leave behind. Other white space is kept so that subjects.IsValidToken rejects it.
func trimNewlines(b []byte) []byte {
	for len(b) > 0 && b[len(b)-1] == '\n' {
		b = b[:len(b)-1]
		if len(b) > 0 && b[len(b)-1] == '\r' {
			b = b[:len(b)-1]
		}
	}
	return b
}
