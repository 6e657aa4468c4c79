package status

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvmapper/kvmapper/wire"
)

// WriteText writes the snapshot as aligned tables: partitions, replicas, then the groups bucket
// with INCOMING, and in the partition-streams layout a table of the partition streams; in direct
// mode a line saying why there is no INCOMING, the control bucket's leases and members, and
// OUTGOING and UNMAPPED instead. Unknown values show as "-".
func (s *Snapshot) WriteText(w io.Writer) error {
	direct := s.Mode == wire.ModeDirect
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tOWNER\tEPOCH\tCHECKPOINT\tLAG\tRATE/S\t")
	for _, p := range s.Partitions {
		owner := p.Owner
		if owner == "" {
			owner = "(none)"
		}
		lag := "-"
		if p.LagFrom != "" {
			lag = strconv.FormatUint(p.Lag, 10)
		}
		rate := "-"
		if p.Rate != nil {
			rate = strconv.FormatFloat(*p.Rate, 'f', 1, 64)
		}
		cp := strconv.FormatUint(p.Checkpoint, 10)
		switch {
		case direct:
			cp = "-" // direct mode writes none
		case p.StaleCheckpoint:
			cp += " (earlier stream)"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t\n", p.Partition, owner, orDash(p.Epoch), cp, lag, rate)
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "REPLICA\tHOST\tVERSION\tUPTIME\tPARTITIONS\tMAPPED\tDEVICES\tTABLE REV\t")
	for _, r := range s.Replicas {
		if r.Report == nil {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t%d\t-\t-\t-\t\n", r.ID, len(r.Leases))
			continue
		}
		rp := r.Report
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t\n", r.ID, rp.Host, rp.Version,
			(time.Duration(rp.UptimeSeconds) * time.Second).String(), len(rp.Owned),
			rp.Counters.Mapped, rp.Table.Devices, rp.Table.Revision)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range s.Replicas {
		if r.Error != "" {
			fmt.Fprintf(w, "replica %s did not report: %s\n", r.ID, r.Error)
		}
	}
	var unowned []string
	for _, p := range s.Partitions {
		if p.Owner == "" {
			unowned = append(unowned, strconv.Itoa(p.Partition))
		}
	}
	if len(unowned) > 0 {
		fmt.Fprintf(w, "unowned partitions: %s\n", strings.Join(unowned, ", "))
	}
	s.writeWaiting(w)
	var stale []string
	for _, p := range s.Partitions {
		if p.StaleCheckpoint {
			stale = append(stale, strconv.Itoa(p.Partition))
		}
	}
	switch {
	case len(stale) > 0 && len(s.Streams) > 0:
		fmt.Fprintf(w, "partitions %s: checkpoint of an earlier %s (their streams were deleted and created again); "+
			"their owners start them from the new stream's first message\n", strings.Join(stale, ", "), s.Incoming.Name)
	case len(stale) > 0:
		fmt.Fprintf(w, "partitions %s: checkpoint of an earlier %s (the stream was deleted and created again at %s); "+
			"their owners start them from the new stream's first message\n",
			strings.Join(stale, ", "), s.Incoming.Name, s.Incoming.Created.UTC().Format(time.RFC3339))
	}
	if direct {
		return s.writeDirect(w, len(unowned))
	}
	fmt.Fprintf(w, "\ngroups bucket %s: %d values, last revision %d\n", s.Groups.Bucket, s.Groups.Values, s.Groups.Revision)
	s.writeInvalid(w)
	if err := s.Parked.writeText(w); err != nil {
		return err
	}
	if len(s.Streams) == 0 {
		fmt.Fprintf(w, "stream %s: %d messages, sequences %d to %d\n", s.Incoming.Name, s.Incoming.Messages, s.Incoming.FirstSeq, s.Incoming.LastSeq)
		return s.writeReplication(w)
	}
	fmt.Fprintf(w, "partition streams %s: %d messages in all\n\n", s.Incoming.Name, s.Incoming.Messages)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STREAM\tMESSAGES\tSEQUENCES\tLEADER\t")
	for _, st := range s.Streams {
		seqs := "-"
		if st.Messages > 0 {
			seqs = fmt.Sprintf("%d..%d", st.FirstSeq, st.LastSeq)
		}
		leader := st.Leader
		if leader == "" {
			leader = "-"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t\n", st.Name, st.Messages, seqs, leader)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	s.writeLeaderCounts(w)
	return s.writeReplication(w)
}

// writeDirect writes what follows the tables in direct mode: why there is no INCOMING, the
// control bucket, the groups bucket, OUTGOING and UNMAPPED, and the replication; unowned is the
// number of partitions without a lease.
func (s *Snapshot) writeDirect(w io.Writer, unowned int) error {
	fmt.Fprintln(w, "\ndirect mode: no INCOMING to read (devices publish to the replicas over core NATS; each partition's owner "+
		"republishes to OUTGOING); LAG is what waits in the owner's queue, and there are no checkpoints")
	fmt.Fprintf(w, "control bucket %s: %d of %d partitions leased, %s\n", s.Control, len(s.Partitions)-unowned, len(s.Partitions), plural(len(s.Replicas), "member"))
	fmt.Fprintf(w, "groups bucket %s: %d values, last revision %d\n", s.Groups.Bucket, s.Groups.Values, s.Groups.Revision)
	s.writeInvalid(w)
	for _, st := range s.Outputs {
		seqs := "no messages"
		if st.Messages > 0 {
			seqs = fmt.Sprintf("%s, sequences %d to %d", plural(int(st.Messages), "message"), st.FirstSeq, st.LastSeq)
		}
		fmt.Fprintf(w, "stream %s: %s\n", st.Name, seqs)
	}
	return s.writeReplication(w)
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// writeReplication writes how each stream is replicated: its leader and its followers, those
// not current with their lag and when their leader last heard from them.
func (s *Snapshot) writeReplication(w io.Writer) error {
	if len(s.Replication) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STREAM\tREPLICAS\tLEADER\tFOLLOWERS\t")
	var errs []string
	for _, r := range s.Replication {
		leader := r.Leader
		switch {
		case r.Error != "":
			leader = "?"
			errs = append(errs, fmt.Sprintf("stream %s: %s", r.Stream, r.Error))
		case leader == "" && r.Replicas > 1:
			leader = "(none: electing)"
		case leader == "":
			leader = "-"
		}
		var fs []string
		for _, f := range r.Followers {
			switch {
			case f.Offline:
				fs = append(fs, fmt.Sprintf("%s (offline, seen %s ago)", f.Name, f.SeenAgo.Round(100*time.Millisecond)))
			case !f.Current:
				fs = append(fs, fmt.Sprintf("%s (lag %d, seen %s ago)", f.Name, f.Lag, f.SeenAgo.Round(100*time.Millisecond)))
			default:
				fs = append(fs, f.Name)
			}
		}
		followers := strings.Join(fs, ", ")
		if followers == "" {
			followers = "-"
		}
		replicas := "?"
		if r.Replicas > 0 {
			replicas = strconv.Itoa(r.Replicas)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t\n", r.Stream, replicas, leader, followers)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, e := range errs {
		fmt.Fprintln(w, e)
	}
	var writes []string
	single := false
	for _, r := range s.Replication {
		if r.WriteMode != "" {
			writes = append(writes, r.Stream+" in "+map[string]string{"atomic": "atomic batches", "batch": "fast-ingest batches", "single": "single publishes"}[r.WriteMode])
			single = single || r.WriteMode == "single"
		}
	}
	if len(writes) > 0 {
		fmt.Fprintf(w, "the lanes write %s", strings.Join(writes, ", "))
		if single {
			fmt.Fprint(w, " (single publishes: a leader change of the stream can reverse a device's order; kvmapper setup says what to change)")
		}
		fmt.Fprintln(w)
	}
	return nil
}

func orDash(v uint64) string {
	if v == 0 {
		return "-"
	}
	return strconv.FormatUint(v, 10)
}

// writeText writes what is parked, if anything: the totals and the devices with the most.
func (pk *Parked) writeText(w io.Writer) error {
	if pk == nil {
		return nil
	}
	if pk.Devices == 0 {
		_, err := fmt.Fprintf(w, "stream %s: nothing parked\n", pk.Stream)
		return err
	}
	fmt.Fprintf(w, "stream %s: %d messages parked, of %d devices without a group (kvmapper unpark releases or drops them)\n", pk.Stream, pk.Messages, pk.Devices)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  PARKED DEVICE\tPARTITION\tMESSAGES\t")
	for _, d := range pk.Top {
		fmt.Fprintf(tw, "  %s\t%d\t%d\t\n", d.Device, d.Partition, d.Messages)
	}
	if n := pk.Devices - len(pk.Top); n > 0 {
		fmt.Fprintf(tw, "  (%d more)\t\t\t\n", n)
	}
	return tw.Flush()
}

// writeInvalid writes how many devices have a value the templates cannot use, as the replica
// whose table is the most recent counts them; nothing when none has.
func (s *Snapshot) writeInvalid(w io.Writer) {
	var best *Report
	for _, r := range s.Replicas {
		if r.Report != nil && (best == nil || r.Report.Table.Revision > best.Table.Revision) {
			best = r.Report
		}
	}
	if best == nil || len(best.Table.Invalid) == 0 {
		return
	}
	total := 0
	var parts []string
	for _, reason := range slices.Sorted(maps.Keys(best.Table.Invalid)) {
		n := best.Table.Invalid[reason]
		total += n
		parts = append(parts, fmt.Sprintf("%s %d", reason, n))
	}
	fmt.Fprintf(w, "%s whose value the templates cannot use (%s), in replica %s's table at revision %d: "+
		"their messages go to UNMAPPED with that reason, or wait in PARKED (--on-unmapped park), until the value is fixed\n",
		plural(total, "device"), strings.Join(parts, ", "), best.Replica, best.Table.Revision)
}

// writeWaiting writes a line for each partition whose owner's lane has been waiting for more
// than a few seconds: for what, on which stream and server, since when.
func (s *Snapshot) writeWaiting(w io.Writer) {
	for _, p := range s.Partitions {
		wt := p.Waiting
		if wt == nil {
			continue
		}
		var what string
		switch wt.For {
		case "publish":
			what = "for " + wt.Stream + " to store its publishes"
		case "consumer":
			what = "for its consumer on " + wt.Stream + " to deliver what the stream holds (the lane replaces it)"
		case "window":
			what = "for room in its replica's in-flight window (other partitions' publishes hold it)"
		case "checkpoint":
			what = "for its checkpoint to be written to " + wt.Stream + " (it takes nothing new meanwhile)"
		default:
			what = "for " + wt.For
		}
		on := ""
		if wt.Server != "" {
			on = " on server " + wt.Server
		}
		fmt.Fprintf(w, "partition %d has waited %s %s%s, since %s\n", p.Partition,
			s.At.Sub(wt.Since).Round(100*time.Millisecond), what, on, wt.Since.UTC().Format("15:04:05.0"))
	}
}
