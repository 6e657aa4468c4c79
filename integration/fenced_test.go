package integration

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/wire"
)

// A replica counts in kvmapper_fenced_total, which the deploy kit's alert watches, each
// partition it stopped because its lease was taken from it, and never one it handed over: here
// a join moves half the partitions (a handover: 0), then another writer overwrites one of the
// leases left, as a newer owner's claim would (1).
func TestFencedPartitionIsCountedAndHandoverIsNot(t *testing.T) {
	e := newEnv(t)
	r0 := e.startMapper("r0", "--metrics-listen", "127.0.0.1:0")
	addr, _ := r0.waitLog("metrics listening", 10*time.Second)["addr"].(string)
	if addr == "" {
		t.Fatal("r0 logged no metrics address")
	}
	url := "http://" + addr + "/metrics"
	value := func(body, series string) (float64, bool) {
		m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindStringSubmatch(body)
		if m == nil {
			return 0, false
		}
		v, err := strconv.ParseFloat(m[1], 64)
		return v, err == nil
	}
	owned := func(want int) string {
		var body string
		natstest.Eventually(t, 30*time.Second, func() error {
			body = httpGet(t, url)
			if n, _ := value(body, "kvmapper_partitions_owned"); int(n) != want {
				return fmt.Errorf("r0 owns %v partitions, want %d", n, want)
			}
			return nil
		})
		return body
	}
	owned(16)
	e.startMapper("r1")
	body := owned(8)
	if n, ok := value(body, "kvmapper_fenced_total"); !ok || n != 0 {
		t.Fatalf("after handing 8 partitions over: kvmapper_fenced_total %v (exported: %v), want 0", n, ok)
	}
	if n, _ := value(body, `kvmapper_ownership_changes_total{change="released"}`); n < 8 {
		t.Fatalf("kvmapper_ownership_changes_total{change=\"released\"} = %v, want the 8 handed over: the test proves nothing", n)
	}

	m := regexp.MustCompile(`(?m)^kvmapper_partition_epoch\{partition="(\d+)"\}`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("r0 exports no kvmapper_partition_epoch:\n%s", body)
	}
	p, _ := strconv.Atoi(m[1])
	if _, err := e.ctl.Put(context.Background(), wire.LeaseKey(p), []byte("intruder")); err != nil {
		t.Fatalf("overwriting lease.%d: %v", p, err)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		if n, _ := value(httpGet(t, url), "kvmapper_fenced_total"); n != 1 {
			return fmt.Errorf("kvmapper_fenced_total %v after lease.%d was taken, want 1", n, p)
		}
		return nil
	})
}
