package bench

import (
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/kvmapper/kvmapper/internal/usage"
	"github.com/kvmapper/kvmapper/subjects"
)

// List splits the comma-separated list s, as kvmapper bench's list flags take them, dropping
// white space and empty items.
func List(s string) []string {
	var out []string
	for v := range strings.SplitSeq(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// ParseSweep reads the lists of kvmapper bench's --messages, --partitions and --replicas
// (positive integers) and --layout (single or streams). Its errors wrap [ErrInvalidConfig] and
// name the flag.
func ParseSweep(messages, partitions, replicas, layouts string) (Sweep, error) {
	var w Sweep
	for _, l := range []struct {
		flag, list string
		to         *[]int
	}{{"messages", messages, &w.Messages}, {"partitions", partitions, &w.Partitions}, {"replicas", replicas, &w.Replicas}} {
		for _, v := range List(l.list) {
			n, err := strconv.Atoi(strings.ReplaceAll(v, "_", ""))
			if err != nil || n < 1 {
				return w, usage.Value(ErrInvalidConfig, l.flag, v, "want positive integers, comma-separated")
			}
			*l.to = append(*l.to, n)
		}
		if len(*l.to) == 0 {
			return w, usage.Errorf(ErrInvalidConfig, "flag --%s is empty", l.flag)
		}
	}
	for _, l := range List(layouts) {
		sl, err := subjects.ParseStreamLayout(l)
		if err != nil {
			return w, usage.Value(ErrInvalidConfig, "layout", l, "use %s or %s", subjects.SingleStream, subjects.PartitionStreams)
		}
		w.Layouts = append(w.Layouts, sl)
	}
	if len(w.Layouts) == 0 {
		return w, usage.Errorf(ErrInvalidConfig, "flag --layout is empty")
	}
	return w, nil
}

// ParseContender reads the key of a contender ([ContenderKeys]) given to flag. Its error wraps
// [ErrInvalidConfig] and names the flag.
func ParseContender(flag, key string) (ContenderName, error) {
	name, ok := ContenderByKey(key)
	if !ok {
		return "", usage.Value(ErrInvalidConfig, flag, key, "choose among %s", strings.Join(ContenderKeys(), ", "))
	}
	return name, nil
}

// Fit readies cfg for the runs of w: with more than one, only the throughput bench runs, and it
// refuses another sub-benchmark, a profile (profiling) and, for lists of partitions or layouts, a
// server of the caller's (cfg.URL): the streams layout's mapping names the partitions. It refuses
// a profile of the bench's own server (srv) with cfg.URL. Its errors wrap [ErrInvalidConfig] and
// name the flags.
func (w Sweep) Fit(cfg *Config, srv ServerConfig, profiling bool) error {
	if w.Runs() > 1 {
		switch {
		case len(cfg.Only) > 1 || len(cfg.Only) == 1 && cfg.Only[0] != Throughput:
			return usage.Errorf(ErrInvalidConfig, "lists in --messages, --partitions, --replicas or --layout run the throughput bench only: drop --only or give --only throughput")
		case profiling:
			return usage.Errorf(ErrInvalidConfig, "profiles cover one run: give single values to --messages, --partitions, --replicas and --layout")
		case cfg.URL != "" && (len(w.Partitions) > 1 || len(w.Layouts) > 1):
			return usage.Errorf(ErrInvalidConfig, "lists in --partitions or --layout need the bench's own server (the streams layout's mapping names the partitions): drop --server")
		}
		cfg.Only = []Kind{Throughput}
	}
	if cfg.URL != "" && srv.CPUProfile != "" {
		return usage.Errorf(ErrInvalidConfig, "--server-cpuprofile needs the bench's own server: drop --server")
	}
	switch {
	case srv.Nodes < 0 || srv.Nodes == 1:
		return usage.Value(ErrInvalidConfig, "cluster", strconv.Itoa(srv.Nodes), "want 2 or more servers (3 for the production default)")
	case srv.Nodes > 1 && cfg.URL != "":
		return usage.Errorf(ErrInvalidConfig, "--cluster starts the bench's own servers: drop --server (or give --stream-replicas to measure a cluster of yours)")
	case srv.Nodes > 1 && cfg.StreamReplicas > 0:
		return usage.Errorf(ErrInvalidConfig, "--cluster sets the streams' replicas itself: drop --stream-replicas")
	case cfg.StreamReplicas < 0:
		return usage.Value(ErrInvalidConfig, "stream-replicas", strconv.Itoa(cfg.StreamReplicas), "want a positive count")
	case cfg.StreamReplicas > 1 && cfg.URL == "":
		return usage.Errorf(ErrInvalidConfig, "--stream-replicas needs a cluster: give --server of yours, or --cluster 3 for the bench's own")
	}
	if srv.Nodes > 1 || cfg.StreamReplicas > 1 {
		switch {
		case len(cfg.Only) == 0:
			cfg.Only = []Kind{Throughput}
		case len(cfg.Only) > 1 || cfg.Only[0] != Throughput:
			return usage.Errorf(ErrInvalidConfig, "a cluster runs the throughput bench only: drop --only or give --only throughput")
		}
	}
	return nil
}

// CreateProfiles creates the files of the kvmapper throughput phase's profiles and sets them in
// cfg: a CPU profile at cpu, and the allocations at mem at its end and mem+".base" at its start
// (go tool pprof -base FILE.base FILE); an empty path asks for none. The caller closes the files
// with done, after the run.
func (c *Config) CreateProfiles(cpu, mem string) (done func(), err error) {
	var files []*os.File
	done = func() {
		for _, f := range files {
			f.Close()
		}
	}
	type profile struct {
		path string
		to   *io.Writer
	}
	profiles := []profile{{cpu, &c.CPUProfile}, {mem, &c.MemProfile}}
	if mem != "" {
		profiles = append(profiles, profile{mem + ".base", &c.MemProfileBase})
	}
	for _, p := range profiles {
		if p.path == "" {
			continue
		}
		f, err := os.Create(p.path)
		if err != nil {
			done()
			return func() {}, err
		}
		files = append(files, f)
		*p.to = f
	}
	return done, nil
}
