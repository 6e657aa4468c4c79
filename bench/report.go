package bench

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// Targets are the figures kvmapper aims for; the report marks each as met or missed.
var Targets = struct {
	RatioCopy, RatioTransform, RatioNaive float64
	AddedP50, AddedP99, ChangeP99         Millis
	ReadySeconds                          Seconds
	BytesPerDevice, LookupNs              float64
}{0.8, 2, 15, 0.3, 2, 10, 5, 150, 100}

// Issue10 are the throughput targets of issue 10, against the contenders a user would write.
var Issue10 = struct{ RatioCeiling, RatioHandWritten float64 }{0.9, 1.3}

// Issue33 are the targets of issue 33 on a replicated stream: kvmapper's rate against the
// atomic-batch relay's, its servers' CPU per message against the same relay's, and the bytes
// OUTGOING stores per message against the plain (async) relay's.
var Issue33 = struct{ RatioAtomic, ServerCPU, Stored float64 }{0.9, 1.2, 1.15}

// issue33 is the line of issue 33's targets, for the contenders that ran.
func (t *ThroughputResult) issue33() string {
	k, atomic, async := t.Get(KVMapper), t.Get(RelayAtomic), t.Get(RelayAsync)
	var out []string
	if x, ok := t.Ratio[RelayAtomic]; ok {
		out = append(out, fmt.Sprintf("≥ %g× atomic relay: %s (%.2f)", Issue33.RatioAtomic, mark(x >= Issue33.RatioAtomic), x))
		if a := atomic.ServerCPUPerMsg(); a > 0 && k.ServerCPU > 0 {
			x := k.ServerCPUPerMsg() / a
			out = append(out, fmt.Sprintf("server CPU/msg ≤ %g× atomic relay's: %s (%.2f)", Issue33.ServerCPU, mark(x <= Issue33.ServerCPU), x))
		}
	}
	if a := async.StoredPerMsg(); a > 0 && k.Messages > 0 {
		x := k.StoredPerMsg() / a
		out = append(out, fmt.Sprintf("stored B/msg ≤ %g× async relay's: %s (%.2f)", Issue33.Stored, mark(x <= Issue33.Stored), x))
	}
	return strings.Join(out, "; ")
}

// servers says what the run ran against: one server, or a cluster and its streams' replicas.
func (r *Report) servers() string {
	n, repl := r.Config["servers"], r.Config["stream_replicas"]
	if n <= 1 && repl <= 1 {
		return "1 server"
	}
	return fmt.Sprintf("%.0f servers, streams R%.0f", n, repl)
}

func mark(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

// WriteText writes r as tables for a terminal.
func (r *Report) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	p := func(format string, a ...any) { fmt.Fprintf(tw, format+"\n", a...) }
	m := r.Machine
	p("machine: %d CPUs, %s, %s, %s; elapsed %.1fs", m.CPUs, m.CPUModel, m.GoVersion, m.OS, float64(r.Elapsed))
	if t := r.Throughput; t != nil {
		p("")
		p("THROUGHPUT: %d messages of %d B, %d devices, %d partitions (%s layout), %d kvmapper replica(s), %s; INCOMING filled at %.0f msgs/s",
			t.Messages, t.Payload, t.Devices, t.Partitions, r.StreamLayout, t.Replicas, r.servers(), t.FillMsgsPerSec)
		p("contender\tmessages\tmsgs/s\tseconds\tstartup s\tserver CPU s\tclient CPU s\tCPU µs/msg\tserver µs/msg\tstored B/msg\tkvmapper ×")
		for _, c := range t.Contenders {
			ratio := "-"
			if x, ok := t.Ratio[c.Name]; ok {
				ratio = fmt.Sprintf("%.2f", x)
			}
			p("%s\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.2f\t%.1f\t%.1f\t%.0f\t%s", c.Name, c.Messages, c.MsgsPerSec, float64(c.Seconds), float64(c.Startup),
				float64(c.ServerCPU), float64(c.ClientCPU), c.CPUPerMsg(), c.ServerCPUPerMsg(), c.StoredPerMsg(), ratio)
		}
		// Without kvmapper in the run there are no allocations, ratios or targets to show.
		if t.Get(KVMapper).Messages > 0 {
			p("kvmapper allocations: %.1f allocs/msg, %.0f B/msg (this process, whole pipeline)", t.AllocsPerMsg, t.BytesPerMsg)
			target := func(name ContenderName, what string, want float64) string {
				x, ok := t.Ratio[name]
				if !ok {
					return what + ": not run"
				}
				return fmt.Sprintf("≥ %g× %s: %s (%.2f)", want, what, mark(x >= want), x)
			}
			naive := target(Naive, "naive", Targets.RatioNaive)
			if _, ok := t.Ratio[Naive]; !ok && r.StreamLayout == "streams" {
				naive = "naive: not run (its one consumer reads one stream)"
			}
			p("targets: %s; %s; %s", target(Copy, "copy", Targets.RatioCopy), target(Transform, "transform", Targets.RatioTransform), naive)
			var more []string
			if x, ok := t.Ratio[RelayCeiling]; ok {
				more = append(more, fmt.Sprintf("≥ %g× relay ceiling: %s (%.2f)", Issue10.RatioCeiling, mark(x >= Issue10.RatioCeiling), x))
			}
			if x, ok := t.Ratio[HandWritten]; ok {
				more = append(more, fmt.Sprintf("≥ %g× hand-written: %s (%.2f)", Issue10.RatioHandWritten, mark(x >= Issue10.RatioHandWritten), x))
			}
			if len(more) > 0 {
				p("targets (issue 10): %s", strings.Join(more, "; "))
			}
			if line := t.issue33(); line != "" {
				p("targets (issue 33): %s", line)
			}
		}
	}
	if l := r.Latency; l != nil {
		p("")
		p("LATENCY: %d msgs/s for %.0fs after a %.1fs warm-up; publish → delivery from OUTGOING, ms", l.Rate, float64(l.Duration), float64(l.Warmup))
		p("path\tsent\treceived\trate\tp50\tp90\tp99\tp99.9\tmax")
		row := func(name string, run LatencyRun) {
			q := run.Latency
			p("%s\t%d\t%d\t%.0f\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f", name, run.Sent, run.Received, run.Rate, q.P50, q.P90, q.P99, q.P999, q.Max)
		}
		row("straight into OUTGOING", l.Direct)
		row("through a bare relay", l.Relay)
		row("through kvmapper", l.KVMapper)
		added := func(name string, a Percentiles) {
			p("%s\t\t\t\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f", name, a.P50, a.P90, a.P99, a.P999, a.Max)
		}
		added("added by the relay", l.RelayAdded)
		added("added by kvmapper", l.Added)
		a := l.Added
		p("targets: added p50 ≤ %.1f ms: %s; added p99 ≤ %.0f ms: %s", Targets.AddedP50, mark(a.P50 <= Targets.AddedP50), Targets.AddedP99, mark(a.P99 <= Targets.AddedP99))
	}
	if c := r.Mapping; c != nil {
		p("")
		p("MAPPING CHANGE: %d changes under %d msgs/s, probe every %.1f ms; Put → first message under the new group, ms", c.Changes, c.Load, c.ProbeInterval)
		p("changes\ttimed out\tp50\tp90\tp99\tmax")
		q := c.Latency
		p("%d\t%d\t%.3f\t%.3f\t%.3f\t%.3f", q.Samples, c.TimedOut, q.P50, q.P90, q.P99, q.Max)
		p("target: p99 ≤ %.0f ms: %s", Targets.ChangeP99, mark(q.P99 <= Targets.ChangeP99 && c.TimedOut == 0))
	}
	if t := r.Table; t != nil {
		p("")
		p("TABLE: %d devices (bucket loaded at %.0f keys/s)", t.Devices, t.LoadMsgsPerSec)
		p("ready s\tB/device\tlookup ns\tallocs/lookup")
		p("%.2f\t%.0f\t%.1f\t%.2f", float64(t.Ready), t.BytesPerDevice, t.LookupNs, t.LookupAllocs)
		p("targets: ready ≤ %.0f s: %s; ≤ %.0f B/device: %s; lookup ≤ %.0f ns: %s",
			float64(Targets.ReadySeconds), mark(t.Ready <= Targets.ReadySeconds), Targets.BytesPerDevice, mark(t.BytesPerDevice <= Targets.BytesPerDevice),
			Targets.LookupNs, mark(t.LookupNs <= Targets.LookupNs))
	}
	if f := r.Failover; f != nil {
		p("")
		p("FAILOVER: %d replica processes, %d msgs/s; SIGKILL of %s (%d partitions), ms after the kill", f.Replicas, f.Rate, f.Victim, len(f.Gaps))
		p("partition\tnew owner\tlease expired\tunowned\tclaimed\tfirst output")
		for _, g := range f.Gaps {
			p("%d\t%s\t%.0f\t%.0f\t%.0f\t%.0f", g.Partition, g.NewOwner, g.KillToExpiry, g.Unowned, g.KillToClaim, g.KillToOutput)
		}
		p("worst\t\t%.0f\t%.0f\t%.0f\t%.0f", f.MaxKillToExpiry, f.MaxUnowned, f.MaxKillToClaim, f.MaxKillToOutput)
		p("published %d, stored in OUTGOING %d, lost %d", f.Published, f.Stored, f.Lost)
	}
	if d := r.Direct; d != nil {
		d.writeText(p)
	}
	return tw.Flush()
}
