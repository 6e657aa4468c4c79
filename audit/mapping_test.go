package audit_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvmapper/kvmapper/audit"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// TestMappingChecked: verify checks every OUTGOING message against the value its
// KVMapper-Prov names (or, stored before it, its KVMapper-Revision), as the templates (out and headers) render it; a message mapped with
// another device's value, a deleted or unusable value, another field or another header fails
// the audit, each named; one whose revision the bucket no longer holds, or that has none, is
// counted unchecked.
func TestMappingChecked(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{region}.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	if lay, err = lay.WithHeaders([]string{"Tenant={tenant}", "Where={region}/{event}"}); err != nil {
		t.Fatal(err)
	}
	e.lay = lay
	ctx := context.Background()
	groups, err := e.js.KeyValue(ctx, "device-groups")
	if err != nil {
		t.Fatal(err)
	}
	put := func(key, value string) uint64 {
		rev, err := groups.PutString(ctx, key, value)
		if err != nil {
			t.Fatal(err)
		}
		return rev
	}
	const good = `{"group":"g7","region":"eu","tenant":"acme"}`
	revA := put("dev-a", good)
	revB := put("dev-b", `{"group":"g8","region":"us","tenant":"beta"}`)
	revBad := put("dev-c", `{"group":"g7","region":"eu.west","tenant":"acme"}`)
	revOld := put("dev-d", good)
	revNew := put("dev-d", `{"group":"g9","region":"ap","tenant":"acme"}`) // the bucket keeps both (history)
	if err := groups.Delete(ctx, "dev-e"); err != nil {
		t.Fatal(err)
	}
	st, err := e.js.Stream(ctx, "KV_device-groups")
	if err != nil {
		t.Fatal(err)
	}
	revDel := st.CachedInfo().State.LastSeq
	gone := put("dev-f", good)
	if err := groups.Purge(ctx, "dev-f"); err != nil { // its history is gone, as a short history would have dropped it
		t.Fatal(err)
	}

	type msg struct {
		device, subject string
		rev             uint64 // 0: no revision in its provenance
		tenant, where   string
	}
	msgs := []msg{
		{"dev-a", "outgoing.eu.g7.dev-a.temp", revA, "acme", "eu/temp"},        // right
		{"dev-d", "outgoing.eu.g7.dev-d.temp", revOld, "acme", "eu/temp"},      // right, with its value of then
		{"dev-d", "outgoing.ap.g9.dev-d.temp", revNew, "acme", "ap/temp"},      // right, after the switch
		{"dev-a", "outgoing.us.g7.dev-a.temp", revA, "acme", "us/temp"},        // wrong region in the subject
		{"dev-a", "outgoing.eu.g7.dev-a.temp", revA, "beta", "eu/temp"},        // wrong tenant header
		{"dev-a", "outgoing.eu.g7.dev-a.temp", revA, "acme", "eu/other"},       // wrong second header
		{"dev-a", "outgoing.us.g8.dev-a.temp", revB, "beta", "us/temp"},        // dev-b's value
		{"dev-c", "outgoing.eu-west.g7.dev-c.temp", revBad, "acme", "eu/temp"}, // an unusable value
		{"dev-e", "outgoing.eu.g7.dev-e.temp", revDel, "acme", "eu/temp"},      // a delete
		{"dev-f", "outgoing.eu.g7.dev-f.temp", gone, "acme", "eu/temp"},        // gone: unchecked
		{"dev-g", "outgoing.eu.g7.dev-g.temp", 0, "acme", "eu/temp"},           // no provenance: unchecked
		{"dev-a", "outgoing.eu.g7.dev-a.temp", revA + 1000, "acme", "eu/temp"}, // never written: unchecked
		{"dev-d", "outgoing.eu.g7.dev-d.temp", revOld, "acme", "eu/temp"},      // right again
	}
	wrong := map[int]string{
		3: "subject outgoing.us.g7.dev-a.temp, but revision " + strconv.FormatUint(revA, 10) + " of dev-a's value renders outgoing.eu.g7.dev-a.temp",
		4: `header Tenant ["beta"], but revision ` + strconv.FormatUint(revA, 10) + ` of dev-a's value renders "acme"`,
		5: `header Where ["eu/other"]`,
		6: "the value of dev-b, not of dev-a",
		7: "whose value the templates cannot use (invalid-field",
		8: "which deletes key dev-e",
	}
	for i, m := range msgs {
		seq := e.in(m.device)[0]
		nm := nats.NewMsg(m.subject)
		nm.Header.Set(nats.MsgIdHdr, e.idPrefixOf(m.device)+strconv.FormatUint(seq, 10))
		switch {
		case m.rev != 0 && (i == 1 || i == 6):
			// Stored before KVMapper-Prov: the three headers it replaced.
			nm.Header.Set(wire.HeaderPartition, strconv.Itoa(subjects.Partition(m.device, lay.Partitions)))
			nm.Header.Set(wire.HeaderEpoch, "3")
			nm.Header.Set(wire.HeaderRevision, strconv.FormatUint(m.rev, 10))
		case m.rev != 0:
			nm.Header.Set(wire.HeaderProvenance, wire.ProvenanceValue(subjects.Partition(m.device, lay.Partitions), 3, m.rev))
		}
		nm.Header.Set("Tenant", m.tenant)
		nm.Header.Set("Where", m.where)
		if _, err := e.js.PublishMsg(ctx, nm); err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	rep := e.run(audit.Config{Names: e.names})
	if rep.OK() || rep.Mappings != uint64(len(wrong)) || rep.MappingChecked != uint64(len(msgs)-3) || rep.MappingUnchecked != 3 {
		t.Fatalf("Run() = OK %v, %d mappings wrong of %d checked, %d unchecked; want false, %d of %d, 3",
			rep.OK(), rep.Mappings, rep.MappingChecked, rep.MappingUnchecked, len(wrong), len(msgs)-3)
	}
	var found []audit.Finding
	for _, f := range rep.Findings {
		if f.Kind == audit.KindMapping {
			found = append(found, f)
		}
	}
	if len(found) != len(wrong) {
		t.Fatalf("%d mapping findings, want %d: %+v", len(found), len(wrong), found)
	}
	for k, i := range []int{3, 4, 5, 6, 7, 8} {
		if f := found[k]; f.Device != msgs[i].device || !strings.Contains(f.Detail, wrong[i]) {
			t.Errorf("finding %d = %+v, want device %s and %q", k, f, msgs[i].device, wrong[i])
		}
	}
	// The same OUTGOING, audited without the header templates, checks the subjects only.
	if e.lay, err = lay.WithHeaders(nil); err != nil {
		t.Fatal(err)
	}
	if rep := e.run(audit.Config{Names: e.names}); rep.Mappings != 4 {
		t.Errorf("without --header: %d mappings wrong, want 4 (the subject, another device's value, an unusable value, a delete): %+v", rep.Mappings, rep.Findings)
	}
	// Without the bucket nothing is checked against a value, and the audit says why; order and
	// gaps are audited as before.
	if err := e.js.DeleteKeyValue(ctx, "device-groups"); err != nil {
		t.Fatal(err)
	}
	if rep := e.run(audit.Config{Names: e.names}); !rep.OK() || rep.MappingChecked != 0 || rep.MappingUnchecked != uint64(len(msgs)) || !strings.Contains(rep.MappingOff, "device-groups") {
		t.Errorf("without the bucket: OK %v, %d checked, %d unchecked, off %q; want true, 0, %d, the bucket named",
			rep.OK(), rep.MappingChecked, rep.MappingUnchecked, rep.MappingOff, len(msgs))
	}
}
