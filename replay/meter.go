package replay

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"
)

// Meter shows a replay's progress: on a terminal one line drawn in place (a bar, the rate and the
// time left) and a summary at the end; elsewhere one JSON object per report, the last one with
// "final": true and the summary. Pass its Report as [Config.Progress]. It is not safe for
// concurrent use (Run calls it from one goroutine).
type Meter struct {
	w        io.Writer
	terminal bool
	shown    bool
	err      error
}

// NewMeter returns a meter writing to w, drawn for a person when terminal is true.
func NewMeter(w io.Writer, terminal bool) *Meter { return &Meter{w: w, terminal: terminal} }

// Err returns the first error writing to w.
func (m *Meter) Err() error { return m.err }

// Report shows p.
func (m *Meter) Report(p Progress) {
	if !m.terminal {
		m.json(p)
		return
	}
	if !p.Final {
		m.printf("\r\033[K%s", bar(p))
		m.shown = true
		return
	}
	if m.shown {
		m.printf("\r\033[K")
	}
	m.summary(p)
}

type jsonProgress struct {
	Progress
	ETASeconds     float64 `json:"eta_seconds"`
	ElapsedSeconds float64 `json:"elapsed_seconds"`
}

func (m *Meter) json(p Progress) {
	b, err := json.Marshal(jsonProgress{Progress: p, ETASeconds: p.ETA.Seconds(), ElapsedSeconds: p.Elapsed.Seconds()})
	if err != nil {
		m.err = err
		return
	}
	m.printf("%s\n", b)
}

func (m *Meter) printf(format string, a ...any) {
	if _, err := fmt.Fprintf(m.w, format, a...); err != nil && m.err == nil {
		m.err = err
	}
}

func bar(p Progress) string {
	const width = 30
	frac := 1.0
	if p.Total > 0 {
		frac = float64(p.Done) / float64(p.Total)
	}
	n := int(frac * width)
	eta := "-"
	if p.Rate > 0 {
		eta = p.ETA.Round(time.Second).String()
	}
	return fmt.Sprintf("replay %s [%s%s] %3.0f%% %d/%d  %.0f msgs/s  ETA %s", p.ID,
		strings.Repeat("#", n), strings.Repeat(".", width-n), 100*frac, p.Done, p.Total, p.Rate, eta)
}

func (m *Meter) summary(p Progress) {
	s := p.Summary
	var ranges []string
	for _, r := range s.Ranges {
		if r.Last < r.First {
			ranges = append(ranges, r.Stream+" (nothing)")
			continue
		}
		ranges = append(ranges, fmt.Sprintf("%s %d..%d", r.Stream, r.First, r.Last))
	}
	verb := "replayed"
	switch {
	case s.DryRun:
		verb = "dry run of"
	case s.AlreadyComplete:
		verb = "already complete:"
	case !s.Complete:
		verb = "stopped part-way through"
	}
	m.printf("replay %s %s %s as of groups revision %d into %s (dead letters: %s)\n", s.ID, verb, strings.Join(ranges, ", "), s.AsOf, s.Into, s.DeadLetters)
	if s.AlreadyComplete {
		m.printf("  nothing to do; give another --id to replay the same range again\n")
		return
	}
	would := ""
	if s.DryRun {
		would = " (would be)"
	}
	m.printf("  read %d, mapped %d%s, dead letters %d, duplicates %d, already stored %d, skipped %d, in %v (%.0f msgs/s)\n",
		s.Read, s.Mapped, would, sum(s.Reasons), s.Duplicates, s.AlreadyStored, s.Skipped, s.Elapsed.Round(time.Millisecond), p.Rate)
	if len(s.Groups) > 0 {
		m.printf("  %-24s %10s\n", "group", "messages")
		for _, g := range slices.Sorted(maps.Keys(s.Groups)) {
			m.printf("  %-24s %10d\n", g, s.Groups[g])
		}
	}
	for _, r := range slices.Sorted(maps.Keys(s.Reasons)) {
		m.printf("  %-24s %10d\n", "dead letter: "+r, s.Reasons[r])
	}
	if s.Dropped > 0 {
		m.printf("  %d dead letters refused even stripped (see the log)\n", s.Dropped)
	}
	if !s.Complete && !s.DryRun {
		m.printf("  to resume where it stopped, run it again with --id %s\n", s.ID)
	}
}

func sum(m map[string]uint64) uint64 {
	var n uint64
	for _, v := range m {
		n += v
	}
	return n
}
