package wire

import "fmt"

// Mode is what devices publish into.
type Mode string

const (
	// ModeStream (the default): devices publish into INCOMING, and the replicas map what it
	// stores.
	ModeStream Mode = "stream"
	// ModeDirect: no stream captures what devices publish; the owner of each partition receives
	// it over core NATS and republishes it to OUTGOING with the device's reply subject, so that
	// the device's acknowledgement comes from OUTGOING. The control bucket records it under
	// [ModeKey].
	ModeDirect Mode = "direct"
)

// ParseMode reads a mode's name, "stream" or "direct"; "" is [ModeStream]. It fails wrapping
// [ErrInvalid] for any other.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case "", ModeStream:
		return ModeStream, nil
	case ModeDirect:
		return m, nil
	}
	return "", fmt.Errorf("%w: mode %q: use %s or %s", ErrInvalid, s, ModeStream, ModeDirect)
}

// Receive says how the owners of the partitions of direct mode receive what devices publish.
type Receive string

const (
	// ReceiveMapping (the default): the server's account mapping (subjects.Layout.MappingSource
	// → MappingDest) stamps the partition on every device subject, and each owner subscribes to
	// its own partitions (subjects.Layout.Filter). The server delivers each message once.
	ReceiveMapping Receive = "mapping"
	// ReceiveAll: the server maps nothing; every replica subscribes to every device subject
	// (subjects.Layout.StreamSubject) and keeps the messages of the partitions it owns. It needs
	// no server configuration, and costs the server one delivery per replica per message.
	ReceiveAll Receive = "all"
)

// ParseReceive reads a receive kind's name, "mapping" or "all"; "" is [ReceiveMapping]. It
// fails wrapping [ErrInvalid] for any other.
func ParseReceive(s string) (Receive, error) {
	switch r := Receive(s); r {
	case "", ReceiveMapping:
		return ReceiveMapping, nil
	case ReceiveAll:
		return r, nil
	}
	return "", fmt.Errorf("%w: receive mode %q: use %s or %s", ErrInvalid, s, ReceiveMapping, ReceiveAll)
}
