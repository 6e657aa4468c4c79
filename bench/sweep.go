package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/kvmapper/kvmapper/subjects"
)

// WriteSweep writes, for reports of throughput runs that differ in layout, partitions, replicas
// or messages, one row per run (kvmapper's rate and kvmapper × every other contender), then the
// scale targets of issue 10 wherever the runs hold both sides of one: the rate at the largest
// backlog against the smallest, at the most partitions against the fewest, and with the most
// replicas against one, the rest of the run being the same.
func WriteSweep(w io.Writer, reps []*Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	p := func(format string, a ...any) { fmt.Fprintf(tw, format+"\n", a...) }
	var others []ContenderName
	for _, k := range Keys {
		for _, r := range reps {
			if t := r.Throughput; t != nil && k.Name != KVMapper && slices.ContainsFunc(t.Contenders, func(c Contender) bool { return c.Name == k.Name }) {
				others = append(others, k.Name)
				break
			}
		}
	}
	p("SWEEP: kvmapper's rate, and kvmapper × each contender in the same run")
	head := "layout\tpartitions\treplicas\tmessages\tkvmapper msgs/s"
	for _, o := range others {
		head += "\t× " + string(o)
	}
	p("%s", head)
	type key struct {
		layout            string
		parts, repl, msgs int
	}
	rate := map[key]float64{}
	var keys []key
	for _, r := range reps {
		t := r.Throughput
		if t == nil {
			continue
		}
		k := key{r.StreamLayout, t.Partitions, t.Replicas, t.Messages}
		rate[k] = t.Get(KVMapper).MsgsPerSec
		keys = append(keys, k)
		row := fmt.Sprintf("%s\t%d\t%d\t%d\t%.0f", k.layout, k.parts, k.repl, k.msgs, rate[k])
		for _, o := range others {
			if x, ok := t.Ratio[o]; ok {
				row += fmt.Sprintf("\t%.2f", x)
			} else {
				row += "\t-"
			}
		}
		p("%s", row)
	}
	// Each scale target compares two runs that differ in one dimension only.
	type target struct {
		vary  func(key) int
		set   func(key, int) key
		ratio float64
		label string
	}
	targets := []target{
		{func(k key) int { return k.msgs }, func(k key, v int) key { k.msgs = v; return k }, 0.9, "messages"},
		{func(k key) int { return k.parts }, func(k key, v int) key { k.parts = v; return k }, 0.9, "partitions"},
		{func(k key) int { return k.repl }, func(k key, v int) key { k.repl = v; return k }, 0.9, "replicas"},
	}
	var lines []string
	for _, tg := range targets {
		var vals []int
		for _, k := range keys {
			if !slices.Contains(vals, tg.vary(k)) {
				vals = append(vals, tg.vary(k))
			}
		}
		if len(vals) < 2 {
			continue
		}
		lo, hi := slices.Min(vals), slices.Max(vals)
		for _, k := range keys {
			if tg.vary(k) != hi {
				continue
			}
			base, ok := rate[tg.set(k, lo)]
			if !ok || base == 0 {
				continue
			}
			x := rate[k] / base
			lines = append(lines, fmt.Sprintf("  %s layout, %d partitions, %d replicas, %d messages: rate ≥ %.1f× the rate at %d %s: %s (%.2f)",
				k.layout, k.parts, k.repl, k.msgs, tg.ratio, lo, tg.label, mark(x >= tg.ratio), x))
		}
	}
	if len(lines) > 0 {
		p("")
		p("scale targets (issue 10), from the runs above:")
		p("%s", strings.Join(lines, "\n"))
	}
	return tw.Flush()
}

// Sweep is what lists of values ask of the throughput bench: one run for every combination, the
// layouts and partition counts outermost (each needs a server of its own).
type Sweep struct {
	Messages, Partitions, Replicas []int
	Layouts                        []subjects.StreamLayout
}

// Runs is the number of runs w asks for.
func (w Sweep) Runs() int {
	return len(w.Messages) * len(w.Partitions) * len(w.Replicas) * len(w.Layouts)
}

// RunSweep runs cfg once for every combination of w, and calls each with every report as it
// comes (a report holds what finished when its run failed). Unless cfg.URL names a server, each
// layout and partition count gets a server of its own, started from the kvmapper binary exe as
// srv says ([StartServer]) and stopped after its runs. It returns the reports and the first
// error, of a run or of each, after which it runs nothing more.
func RunSweep(ctx context.Context, cfg Config, w Sweep, exe string, srv ServerConfig, each func(*Report) error) ([]*Report, error) {
	var reps []*Report
	for _, sl := range w.Layouts {
		for _, parts := range w.Partitions {
			if err := sweepServer(ctx, cfg, w, exe, srv, sl, parts, func(r *Report) error {
				reps = append(reps, r)
				return each(r)
			}); err != nil {
				return reps, err
			}
		}
	}
	return reps, nil
}

// sweepServer runs the runs of w with layout sl and parts partitions.
func sweepServer(ctx context.Context, cfg Config, w Sweep, exe string, srv ServerConfig, sl subjects.StreamLayout, parts int, each func(*Report) error) error {
	cfg.StreamLayout, cfg.Partitions = sl, parts
	if cfg.URL == "" {
		srv.StreamLayout, srv.Partitions, srv.DirectIn = sl, parts, DirectMappedIn
		var s Servers
		var err error
		if srv.Nodes > 1 {
			s, err = StartCluster(ctx, exe, srv)
			cfg.StreamReplicas = min(srv.Nodes, 3)
		} else {
			s, err = StartServer(ctx, exe, srv)
		}
		if err != nil {
			return err
		}
		defer s.Stop()
		cfg.URL, cfg.ServerPIDs = s.URL(), s.PIDs()
		if srv.CPUProfile != "" {
			cfg.ServerProfile = s.Profile
		}
	}
	for _, r := range w.Replicas {
		for _, n := range w.Messages {
			run := cfg
			run.Replicas, run.Messages = r, n
			rep, err := Run(ctx, run)
			if rep != nil {
				if werr := each(rep); werr != nil && err == nil {
					err = werr
				}
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// WriteJSON writes reps as indented JSON: the one report of a single run as an object, or, for
// a sweep, all of them as an array.
func WriteJSON(w io.Writer, reps []*Report, sweep bool) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if !sweep && len(reps) == 1 {
		return enc.Encode(reps[0])
	}
	return enc.Encode(reps)
}
