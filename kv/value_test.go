package kv_test

import (
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// metaLayout routes on outgoing.{region}.{group}.{device}.{event} with a Tenant header.
func metaLayout(t testing.TB) *subjects.Layout {
	t.Helper()
	l, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{region}.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	if l, err = l.WithHeaders([]string{"Tenant={tenant}"}); err != nil {
		t.Fatal(err)
	}
	return l
}

func metaSchema(t testing.TB) *subjects.Schema { return metaLayout(t).Schema() }

// rendered is what metaLayout renders for a message of device with values v: its subject and
// its Tenant header, "<subject> Tenant=<tenant>".
func rendered(t testing.TB, device string, v subjects.Values) string {
	t.Helper()
	l := metaLayout(t)
	var f subjects.Fields
	if err := l.Parse("incoming."+strconv.Itoa(subjects.Partition(device, 16))+"."+device+".evt", &f); err != nil {
		t.Fatal(err)
	}
	return string(l.AppendOut(nil, &f, v)) + " Tenant=" + string(l.AppendHeader(nil, 0, &f, v))
}

// TestStructuredValues: JSON values through a real bucket and watch, each field where the
// templates want it, a change of several fields applied at once, and every bad value held with
// the reason and field it fails on, counted by reason until it is fixed or deleted.
func TestStructuredValues(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	tb := newTable(t, b, kv.Config{Schema: metaSchema(t)})
	run(t, tb)
	waitReady(t, tb)

	fieldsAre := func(device string, rev uint64, region, group, tenant string) func() error {
		return func() error {
			e, ok := tb.Lookup(device)
			want := fmt.Sprintf("outgoing.%s.%s.%s.evt Tenant=%s", region, group, device, tenant)
			if !ok || e.Invalid || e.Revision != rev || rendered(t, device, e.Values) != want || e.Group != group {
				return fmt.Errorf("Lookup(%s) = %+v, %v; want region %s, group %s, tenant %s at revision %d", device, e, ok, region, group, tenant, rev)
			}
			return nil
		}
	}
	rev := put(t, b, "dev-42", `{"group":"g7","region":"eu","tenant":"acme","notes":{"any":["thing"]}}`)
	natstest.Eventually(t, wait, fieldsAre("dev-42", rev, "eu", "g7", "acme"))
	rev = put(t, b, "dev-42", `{"group":"g8","region":"us","tenant":"acme"}`+"\n")
	natstest.Eventually(t, wait, fieldsAre("dev-42", rev, "us", "g8", "acme"))

	bad := []struct {
		device, value, reason, field string
	}{
		{"plain", "g7", wire.ReasonMissingField, "region"},
		{"no-tenant", `{"group":"g7","region":"eu"}`, wire.ReasonMissingField, "tenant"},
		{"null", `{"group":"g7","region":null,"tenant":"t"}`, wire.ReasonMissingField, "region"},
		{"dotted", `{"group":"g7","region":"eu.west","tenant":"t"}`, wire.ReasonInvalidField, "region"},
		{"nested", `{"group":{"id":7},"region":"eu","tenant":"t"}`, wire.ReasonInvalidField, "group"},
		{"crlf", `{"group":"g7","region":"eu","tenant":"a\r\nNats-Msg-Id: x"}`, wire.ReasonInvalidField, "tenant"},
		{"broken", `{"group":"g7",`, wire.ReasonInvalidValue, ""},
		{"twice", `{"group":"g7","group":"g8","region":"eu","tenant":"t"}`, wire.ReasonInvalidValue, "group"},
	}
	for _, c := range bad {
		rev := put(t, b, c.device, c.value)
		natstest.Eventually(t, wait, func() error {
			e, ok := tb.Lookup(c.device)
			if !ok || !e.Invalid || e.Revision != rev || e.Reason != c.reason || e.Field != c.field || e.Detail == "" || e.Values != (subjects.Values{}) {
				return fmt.Errorf("Lookup(%s) = %+v, %v; want invalid at revision %d with reason %s, field %q", c.device, e, ok, rev, c.reason, c.field)
			}
			return nil
		})
	}
	if m := tb.Mapping("dotted"); m.Mapped() || m.Reason() != wire.ReasonInvalidField || m.Field() != "region" || m.Detail() == "" {
		t.Errorf("Mapping(dotted) = %q, %q, %q; want invalid-field, region, a why", m.Reason(), m.Field(), m.Detail())
	}
	if m := tb.Mapping("nobody"); m.Mapped() || m.Reason() != wire.ReasonNoMapping {
		t.Errorf("Mapping(nobody) = %q, want %s", m.Reason(), wire.ReasonNoMapping)
	}
	if m := tb.Mapping("dev-42"); !m.Mapped() || rendered(t, "dev-42", m.Values) != "outgoing.us.g8.dev-42.evt Tenant=acme" || m.Revision == 0 {
		t.Errorf("Mapping(dev-42) = %+v, want g8", m)
	}
	want := map[string]int{wire.ReasonMissingField: 3, wire.ReasonInvalidField: 3, wire.ReasonInvalidValue: 2}
	if got := tb.Invalid(); !maps.Equal(got, want) {
		t.Errorf("Invalid() = %v, want %v", got, want)
	}
	// Fixed, deleted: no longer counted.
	rev = put(t, b, "plain", `{"group":"g7","region":"eu","tenant":"t"}`)
	natstest.Eventually(t, wait, fieldsAre("plain", rev, "eu", "g7", "t"))
	if err := b.Delete(t.Context(), "broken"); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, wait, absent(tb, "broken"))
	// The counts are counters beside the table, which its writer brings down when it lets go
	// of a record, just after it published the entry's change: a reader can see the device
	// gone a moment before its count (a fresh-clone run of 2026-12-08 did).
	want = map[string]int{wire.ReasonMissingField: 2, wire.ReasonInvalidField: 3, wire.ReasonInvalidValue: 1}
	natstest.Eventually(t, wait, func() error {
		if got := tb.Invalid(); !maps.Equal(got, want) {
			return fmt.Errorf("Invalid() = %v after a fix and a delete, want %v", got, want)
		}
		return nil
	})
}

// TestRecordsShared: devices with the same value share one record; a record no device uses any
// more gives its index back, and the next new value takes it.
func TestRecordsShared(t *testing.T) {
	tb := kv.NewUnbound(kv.Config{Schema: metaSchema(t)})
	for i := range 1000 {
		tb.PutForTest(fmt.Sprintf("dev-%d", i), fmt.Sprintf(`{"group":"g%d","region":"r%d","tenant":"acme"}`, i%10, i%5), uint64(i+1))
	}
	if n, free := tb.RecordsForTest(); n != 10 || free != 0 {
		t.Fatalf("1000 devices on 10 distinct values: %d records, %d free; want 10 and 0", n, free)
	}
	for i := 0; i < 1000; i += 10 { // every device of g0/r0
		tb.PutForTest(fmt.Sprintf("dev-%d", i), `{"group":"g0","region":"r9","tenant":"acme"}`, uint64(2000+i))
	}
	if n, free := tb.RecordsForTest(); n != 11 || free != 1 {
		t.Fatalf("after moving every device off one value: %d records, %d free; want 11 and 1", n, free)
	}
	tb.PutForTest("dev-new", `{"group":"g0","region":"r8","tenant":"acme"}`, 5000)
	if n, free := tb.RecordsForTest(); n != 11 || free != 0 {
		t.Fatalf("a new value after a freed one: %d records, %d free; want 11 and 0 (the index reused)", n, free)
	}
	for i := 1; i < 1000; i += 10 {
		tb.DeleteForTest(fmt.Sprintf("dev-%d", i), uint64(6000+i))
	}
	if _, free := tb.RecordsForTest(); free != 1 {
		t.Fatalf("after deleting every device of one value: %d free; want 1", free)
	}
	if e, ok := tb.Lookup("dev-new"); !ok || rendered(t, "dev-new", e.Values) != "outgoing.r8.g0.dev-new.evt Tenant=acme" {
		t.Fatalf("Lookup(dev-new) = %+v, %v; want the value it was put with", e, ok)
	}
}

// TestRecordReuseUnderReaders: while one writer keeps giving every device a value of its own
// (each put frees the device's previous record, whose index the next put reuses at once),
// readers never see a record of another device or another revision. Run with -race: the
// detector also sees a record read outside the lock that orders it.
func TestRecordReuseUnderReaders(t *testing.T) {
	tb := kv.NewUnbound(kv.Config{Schema: metaSchema(t)})
	const devices = 64
	value := func(d int, rev uint64) string {
		return fmt.Sprintf(`{"group":"g%d","region":"dev-%d","tenant":"%d"}`, rev, d, rev)
	}
	var rev uint64
	for d := range devices {
		rev++
		tb.PutForTest(fmt.Sprintf("dev-%d", d), value(d, rev), rev)
	}
	lay := metaLayout(t)
	// render is rendered without the test's helpers, which readers must not call (t.Fatal).
	render := func(device string, v subjects.Values) string {
		var f subjects.Fields
		if err := lay.Parse("incoming."+strconv.Itoa(subjects.Partition(device, 16))+"."+device+".evt", &f); err != nil {
			return err.Error()
		}
		return string(lay.AppendOut(nil, &f, v)) + " Tenant=" + string(lay.AppendHeader(nil, 0, &f, v))
	}
	var stop atomic.Bool
	var wrong atomic.Value
	var wg sync.WaitGroup
	for r := range 4 {
		wg.Go(func() {
			for i := r; !stop.Load(); i++ {
				d := i % devices
				dev := fmt.Sprintf("dev-%d", d)
				e, ok := tb.Lookup(dev)
				want := fmt.Sprintf("outgoing.%s.g%d.%s.evt Tenant=%d", dev, e.Revision, dev, e.Revision)
				if !ok || e.Invalid || e.Group != fmt.Sprintf("g%d", e.Revision) || render(dev, e.Values) != want {
					wrong.Store(fmt.Sprintf("Lookup(%s) = %+v, %v: fields of another device or revision", dev, e, ok))
					return
				}
			}
		})
	}
	for range 20000 {
		rev++
		d := int(rev) % devices
		tb.PutForTest(fmt.Sprintf("dev-%d", d), value(d, rev), rev)
	}
	stop.Store(true)
	wg.Wait()
	if w := wrong.Load(); w != nil {
		t.Fatal(w)
	}
	if n, free := tb.RecordsForTest(); n > devices+1 || free > 1 {
		t.Errorf("%d records (%d free) for %d devices with a value each: indexes are not reused", n, free, devices)
	}
}
