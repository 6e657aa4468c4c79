package status

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
)

// writeLeaderCounts writes, on a cluster, how many partition streams each server leads: the
// spread `kvmapper setup` evens out. Servers holding a replica and leading none count 0; a
// stream electing its leader counts for nobody. It writes nothing when the partition streams
// are not replicated.
func (s *Snapshot) writeLeaderCounts(w io.Writer) {
	counts := map[string]int{}
	replicated := false
	for _, r := range s.Replication {
		if !slices.ContainsFunc(s.Streams, func(st Stream) bool { return st.Name == r.Stream }) {
			continue
		}
		replicated = replicated || r.Replicas > 1
		for _, f := range r.Followers {
			counts[f.Name] += 0
		}
		if r.Leader != "" {
			counts[r.Leader]++
		}
	}
	if !replicated || len(counts) == 0 {
		return
	}
	names := slices.Sorted(maps.Keys(counts))
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = fmt.Sprintf("%s %d", n, counts[n])
	}
	vs := slices.Collect(maps.Values(counts))
	hint := ""
	if slices.Max(vs)-slices.Min(vs) > 1 {
		hint = " (uneven: `kvmapper setup` spreads them)"
	}
	fmt.Fprintf(w, "partition streams led per server: %s%s\n", strings.Join(parts, ", "), hint)
}
