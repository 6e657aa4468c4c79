package status

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ShowConfig says what [Show] prints and how often.
type ShowConfig struct {
	// Read says what to read.
	Read ReadConfig
	// JSON prints each snapshot as one line of JSON instead of tables.
	JSON bool
	// Watch refreshes every Interval until ctx ends; without it Show prints once.
	Watch    bool
	Interval time.Duration
	// RateWindow, without Watch, is the time between the two samples the rates are taken from;
	// 0 reads once and shows no rate. With Watch the rates come from one refresh to the next.
	RateWindow time.Duration
	// Redraw, with Watch and without JSON, clears the terminal before each refresh and heads it
	// with the time; otherwise refreshes follow one another, a blank line between them.
	Redraw bool
}

// Show reads the deployment with [Read] and writes it to w as [Snapshot.WriteText] or JSON: once,
// or with cfg.Watch every cfg.Interval until ctx ends (then it returns nil). Each read may take
// cfg.Read.Timeout plus 10s. It fails on the first read or write that fails.
func Show(ctx context.Context, js jetstream.JetStream, cfg ShowConfig, w io.Writer) error {
	read := func(prev *Snapshot) (*Snapshot, error) {
		rctx, cancel := context.WithTimeout(ctx, cfg.Read.Timeout+10*time.Second)
		defer cancel()
		s, err := Read(rctx, js, cfg.Read)
		if err != nil {
			return nil, err
		}
		s.SetRates(prev)
		return s, nil
	}
	write := func(s *Snapshot) error {
		if !cfg.JSON {
			return s.WriteText(w)
		}
		b, err := json.Marshal(s)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	if !cfg.Watch {
		s, err := read(nil)
		if err != nil {
			return err
		}
		if cfg.RateWindow > 0 {
			if !sleep(ctx, cfg.RateWindow) {
				return nil
			}
			if s, err = read(s); err != nil {
				return err
			}
		}
		return write(s)
	}
	redraw := cfg.Redraw && !cfg.JSON
	var prev *Snapshot
	for {
		s, err := read(prev)
		if err != nil {
			return err
		}
		if redraw {
			fmt.Fprint(w, "\033[H\033[2J")
			fmt.Fprintf(w, "kvmapper status  %s  (every %v; Ctrl-C stops)\n\n", s.At.Format(time.TimeOnly), cfg.Interval)
		} else if !cfg.JSON && prev != nil {
			fmt.Fprintln(w)
		}
		if err := write(s); err != nil {
			return err
		}
		prev = s
		if !sleep(ctx, cfg.Interval) {
			return nil
		}
	}
}

// sleep waits for d and reports true, or false when ctx ends first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
