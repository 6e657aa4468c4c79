package bench_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/subjects"
)

// The direct run measures every path when the server maps the direct subjects (as the bench's
// own server does). TestRun runs it on a server that does not, where it skips the mapping path.
func TestRunDirect(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	lay, err := subjects.NewLayout(bench.DirectMappedIn, "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.GlobalAccount().AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := tiny(srv.URL())
	cfg.Only = []bench.Kind{bench.Direct}
	rep, err := bench.Run(ctx, cfg)
	if err != nil {
		t.Fatalf("Run() error = %v", err)
	}
	d := rep.Direct
	if d == nil {
		t.Fatal("Run().Direct = nil")
	}
	want := []string{bench.PathStraight, bench.PathStream, bench.PathDirectMapped, bench.PathDirectAll, bench.PathDirectProvenance}
	if len(d.Paths) != len(want) {
		t.Fatalf("%d paths (skipped %v), want %v", len(d.Paths), d.Skipped, want)
	}
	for i, p := range d.Paths {
		if p.Name != want[i] || p.Errors != 0 || p.Sent == 0 || p.Ack.Samples == 0 || p.Ack.P50 <= 0 ||
			p.Delivery.Samples == 0 || p.AckedPerSec <= 0 || p.StoredPerSec <= 0 || p.Messages != 2000 {
			t.Errorf("path %d = %+v, want %s with acknowledgements, deliveries and rates, and no error", i, p, want[i])
		}
		if i > 0 && d.Ratio[p.Name] <= 0 {
			t.Errorf("Ratio[%s] = %v, want > 0", p.Name, d.Ratio[p.Name])
		}
	}
	var text bytes.Buffer
	if err := rep.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(text.String(), "DIRECT MODE") || !strings.Contains(text.String(), bench.PathDirectAll) {
		t.Errorf("WriteText() output lacks the direct run:\n%s", text.String())
	}
}
