package subjects

import (
	"cmp"
	"fmt"
	"strconv"
	"strings"
)

// Names are the streams and buckets one kvmapper deployment uses. Zero fields mean the defaults
// ([DefaultNames]); every one of them is a flag of every command.
type Names struct {
	// Incoming is the stream devices publish into or, with [PartitionStreams], the prefix of the
	// partition streams' names (see [Names.IncomingStream]).
	Incoming string
	Outgoing string // the stream mapped messages go to
	Unmapped string // the stream dead letters go to
	Groups   string // the KV bucket of device id → group id
	Control  string // the KV bucket of leases, members and checkpoints
	// StreamLayout says how INCOMING is stored: one stream, or one per partition.
	StreamLayout StreamLayout
	// Parked is the stream that holds the messages of parked devices (see [ParkedSubject]).
	Parked string
	// ParkedPrefix is the first token(s) of the parked subjects, "<ParkedPrefix>.<p>.<device>".
	ParkedPrefix string
}

// DefaultNames are the names kvmapper uses unless told otherwise.
var DefaultNames = Names{Incoming: "INCOMING", Outgoing: "OUTGOING", Unmapped: "UNMAPPED", Groups: "device-groups", Control: "kvmapper",
	StreamLayout: SingleStream, Parked: "PARKED", ParkedPrefix: "parked"}

// WithDefaults returns n with each empty name set to its default.
func (n Names) WithDefaults() Names {
	d := DefaultNames
	return Names{
		Incoming:     cmp.Or(n.Incoming, d.Incoming),
		Outgoing:     cmp.Or(n.Outgoing, d.Outgoing),
		Unmapped:     cmp.Or(n.Unmapped, d.Unmapped),
		Groups:       cmp.Or(n.Groups, d.Groups),
		Control:      cmp.Or(n.Control, d.Control),
		StreamLayout: cmp.Or(n.StreamLayout, d.StreamLayout),
		Parked:       cmp.Or(n.Parked, d.Parked),
		ParkedPrefix: cmp.Or(n.ParkedPrefix, d.ParkedPrefix),
	}
}

// StreamLayout says how the INCOMING messages are stored. Both layouts store a message published
// to incoming.{device}.{event} under the same subject, incoming.<partition>.{device}.{event}, so
// parsing, mapping and the Nats-Msg-Id scheme are the same in both; what differs is which
// stream holds partition p and how a lane reads it ([Names.IncomingStream]).
type StreamLayout string

const (
	// SingleStream keeps every partition in one stream, INCOMING, whose subject transform stamps
	// the partition on ingest; a lane reads it with a consumer filtered on its partition. It
	// needs nothing from the server's configuration.
	SingleStream StreamLayout = "single"
	// PartitionStreams keeps partition p in a stream of its own, INCOMING-<p>, capturing
	// incoming.<p>.>; an account subject mapping on the server ([Layout.MappingSource] →
	// [Layout.MappingDest]) stamps the partition on publish. A lane reads its stream unfiltered,
	// which costs the server one load per message whatever the number of partitions, and on a
	// cluster each partition stream has its own leader.
	PartitionStreams StreamLayout = "streams"
	// AutoLayout is no layout but a request for one: the command line's default, which
	// package setup resolves (setup.ChooseLayout, setup.RecordedLayout) into the deployment's
	// layout, recorded in the control bucket under wire.LayoutKey, before anything reads INCOMING.
	// The packages that read INCOMING take only a resolved layout; [ParseStreamLayout] does not
	// accept it.
	AutoLayout StreamLayout = "auto"
)

// ParseStreamLayout reads a layout's name, "single" or "streams"; "" is [SingleStream].
func ParseStreamLayout(s string) (StreamLayout, error) {
	switch l := StreamLayout(s); l {
	case "", SingleStream:
		return SingleStream, nil
	case PartitionStreams:
		return l, nil
	}
	return "", fmt.Errorf("%w: stream layout %q: use %s or %s", ErrInvalidLayout, s, SingleStream, PartitionStreams)
}

// PartitionStream is the name of partition p's stream in the [PartitionStreams] layout:
// "<Incoming>-<p>", e.g. "INCOMING-7".
func (n Names) PartitionStream(p int) string {
	return cmp.Or(n.Incoming, DefaultNames.Incoming) + "-" + strconv.Itoa(p)
}

// IncomingStream returns the stream that holds partition p and the filter a consumer reading
// only p uses on it: INCOMING and "incoming.<p>.>" in the [SingleStream] layout, INCOMING-<p>
// and "" (everything) in the [PartitionStreams] layout.
func (n Names) IncomingStream(lay *Layout, p int) (stream, filter string) {
	if n.StreamLayout == PartitionStreams {
		return n.PartitionStream(p), ""
	}
	return cmp.Or(n.Incoming, DefaultNames.Incoming), lay.Filter(p)
}

// IncomingStreams returns every stream that holds INCOMING messages: INCOMING alone, or the
// partitions' streams in partition order.
func (n Names) IncomingStreams(partitions int) []string {
	if n.StreamLayout != PartitionStreams {
		return []string{cmp.Or(n.Incoming, DefaultNames.Incoming)}
	}
	out := make([]string, partitions)
	for p := range out {
		out[p] = n.PartitionStream(p)
	}
	return out
}

// BucketStream is the name of the stream behind KV bucket b, as the server names it.
func BucketStream(b string) string { return "KV_" + b }

// ParkedSubject is the subject a parked message of device, in partition p, is stored under in
// the PARKED stream: "<prefix>.<p>.<device>", one subject per device, so that the stream's
// per-subject limit is a per-device limit.
func ParkedSubject(prefix string, p int, device string) string {
	return prefix + "." + strconv.Itoa(p) + "." + device
}

// ParkedFilter is the filter of partition p's parked subjects, "<prefix>.<p>.>".
func ParkedFilter(prefix string, p int) string { return prefix + "." + strconv.Itoa(p) + ".>" }

// ParkedDevice returns the device and partition of a parked subject of prefix, and false for
// any other subject.
func ParkedDevice(prefix, subject string) (device string, p int, ok bool) {
	rest, found := strings.CutPrefix(subject, prefix+".")
	if !found {
		return "", -1, false
	}
	ps, device, found := strings.Cut(rest, ".")
	if !found || device == "" || strings.Contains(device, ".") {
		return "", -1, false
	}
	n, err := strconv.Atoi(ps)
	if err != nil || n < 0 || strconv.Itoa(n) != ps {
		return "", -1, false
	}
	return device, n, true
}

// FencePrefix is the first two tokens of every fence subject. Output streams capture their
// partitions' fence subjects beside their own; the templates' subjects must not overlap them.
const FencePrefix = "kvmapper.fence"

// FenceSubject is partition p's fence subject in the incarnation inc (wire.Incarnation of its
// creation time) of the output stream named stream: "kvmapper.fence.<stream>.<p>.<inc>". A
// partition's owner writes its fence record there (wire.FenceRecord) before its first write to
// the stream, and every later write checks it. The incarnation keeps a stream deleted and made
// again, whose sequences start from 1, from holding a successor's record at the very sequence
// a deposed owner's checks expect: they name the old incarnation's subject, on which the new
// stream holds nothing. (Builds before it wrote "kvmapper.fence.<stream>.<p>".)
func FenceSubject(stream string, p int, inc string) string {
	return FencePrefix + "." + stream + "." + strconv.Itoa(p) + "." + inc
}

// FenceFilter is the subject an output stream named stream captures its fence subjects with.
func FenceFilter(stream string) string { return FencePrefix + "." + stream + ".>" }
