package audit

import (
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// Rate is how fast the audit read the outputs, in messages a second.
func (r *Report) Rate() float64 {
	if s := r.Elapsed.Seconds(); s > 0 {
		return float64(r.Outgoing+r.Unmapped) / s
	}
	return 0
}

// WriteJSON writes r as one indented JSON document, with "ok" ([Report.OK]), "seconds" and
// "msgs_per_sec" ([Report.Rate]) besides its fields. A nil Findings is written as [].
func (r *Report) WriteJSON(w io.Writer) error {
	if r.Findings == nil {
		r.Findings = []Finding{}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		OK bool `json:"ok"`
		*Report
		Seconds    float64 `json:"seconds"`
		MsgsPerSec float64 `json:"msgs_per_sec"`
	}{r.OK(), r, r.Elapsed.Seconds(), r.Rate()})
}

// WriteText writes r for people: one line saying OK and what was audited, or FAILED with the
// count of each kind of problem and the examples found. names are the deployment's streams.
func (r *Report) WriteText(w io.Writer, names subjects.Names) error {
	var err error
	p := func(format string, a ...any) {
		if err == nil {
			_, err = fmt.Fprintf(w, format, a...)
		}
	}
	in, out, unm := names.Incoming, names.Outgoing, names.Unmapped
	// What was audited: INCOMING's range, or every partition stream's.
	audited := fmt.Sprintf("%d %s messages (seq %d..%d)", r.Incoming, in, r.IncomingFirst, r.IncomingLast)
	failed := fmt.Sprintf("%s seq %d..%d (%d messages)", in, r.IncomingFirst, r.IncomingLast, r.Incoming)
	if n := len(r.Ranges); names.StreamLayout == subjects.PartitionStreams && n > 0 {
		audited = fmt.Sprintf("%d messages of the %d partition streams %s … %s", r.Incoming, n, r.Ranges[0].Stream, r.Ranges[n-1].Stream)
		failed = fmt.Sprintf("the partition streams %s … %s (%d messages)", r.Ranges[0].Stream, r.Ranges[n-1].Stream, r.Incoming)
		in += "-<p>"
	}
	speed := fmt.Sprintf("read %d messages in %v (%.0f msgs/s)", r.Outgoing+r.Unmapped, r.Elapsed.Round(time.Millisecond), r.Rate())
	var extra string
	if r.Foreign > 0 {
		extra += fmt.Sprintf(" %d foreign messages (no %s:<seq> Nats-Msg-Id) were not judged.", r.Foreign, in)
	}
	if r.Parked > 0 {
		extra += fmt.Sprintf(" %d messages are parked in %s (their devices have no group yet): held, not missing.", r.Parked, names.Parked)
	}
	if r.OutOfRange > 0 {
		extra += fmt.Sprintf(" %d messages name sequences outside %s's range and were checked for order only.", r.OutOfRange, in)
	}
	switch {
	case r.MappingOff != "" && r.MappingUnchecked > 0:
		extra += fmt.Sprintf(" %d messages of %s were not checked against the value they were mapped with: %s.", r.MappingUnchecked, out, r.MappingOff)
	case r.MappingUnchecked > 0:
		extra += fmt.Sprintf(" %d messages of %s could not be checked against the value they were mapped with "+
			"(no revision in %s, or one the groups bucket no longer holds).", r.MappingUnchecked, out, wire.HeaderProvenance)
	}
	if r.OK() {
		mapped := ""
		if r.MappingChecked > 0 {
			mapped = fmt.Sprintf("%d of %s as the value each was mapped with renders it; ", r.MappingChecked, out)
		}
		p("OK: all %s are in %s (%d) or %s (%d), once each; %s, "+
			"each in order; no stale epoch; %s%s.%s\n",
			audited, out, r.Outgoing, unm, r.Unmapped, plural(r.Devices, "device"), mapped, speed, extra)
		return err
	}
	p("FAILED: %s against %s (%d read) and %s (%d read), %s; %s.%s\n",
		failed, out, r.Outgoing, unm, r.Unmapped, plural(r.Devices, "device"), speed, extra)
	for _, k := range []struct {
		name string
		n    uint64
	}{
		{KindMissing, r.Missing}, {KindDuplicate, r.Duplicates}, {KindReorder, r.Reorders},
		{KindStaleEpoch, r.StaleEpochs}, {KindMapping, r.Mappings}, {KindForeign, r.Foreign},
	} {
		p("  %-12s %d\n", k.name, k.n)
	}
	if len(r.Findings) > 0 {
		p("examples:\n")
	}
	for _, f := range r.Findings {
		dev := f.Device
		if dev == "" {
			dev = "-"
		}
		p("  %-12s %s #%d device %s: %s\n", f.Kind, f.Stream, f.StreamSeq, dev, f.Detail)
	}
	return err
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}
