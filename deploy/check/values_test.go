package check

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmapper/kvmapper/deploy/chart"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// A key that is no flag under config or setupJob.config, and a value the chart does not have,
// fail the render (values.schema.json) instead of becoming a variable kvmapper ignores or a
// value nothing reads; so does a header entry with a comma, which KVMAPPER_HEADER cannot carry.
func TestChartRefusesUnknownKeys(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values map[string]any
		want   string
	}{
		{"a config key that is no flag", map[string]any{"config": map[string]any{"drain-timout": "20s"}}, "drain-timout"},
		{"a flag the chart sets itself", map[string]any{"config": map[string]any{"server": "nats://x:4222"}}, "server"},
		{"a flag of run under setupJob.config", map[string]any{"setupJob": map[string]any{"config": map[string]any{"drain-timeout": "1s"}}}, "drain-timeout"},
		{"a value the chart does not have", map[string]any{"replicas": 3}, "replicas"},
		{"a misspelt value of a group", map[string]any{"podDisruptionBudget": map[string]any{"maxUnavaliable": 2}}, "maxUnavaliable"},
		{"a header with a comma", map[string]any{"config": map[string]any{"header": []any{"Pair={a},{b}"}}}, "comma"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := chart.Render(chart.Dir(built.deploy), release, tc.values)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("rendering with %v: %v, want an error naming %q", tc.values, err, tc.want)
			}
		})
	}
}

// values.schema.json names every value of values.yaml where it refuses unknown keys, and
// nothing values.yaml does not have: each object of the schema with additionalProperties false
// has exactly the keys of the map at its path in values.yaml (global, which Helm gives every
// chart, aside).
func TestChartSchemaCoversTheValues(t *testing.T) {
	var schema map[string]any
	if err := json.Unmarshal([]byte(readFile(t, filepath.Join(chart.Dir(built.deploy), "values.schema.json"))), &schema); err != nil {
		t.Fatalf("values.schema.json: %v", err)
	}
	values, err := chart.LoadValues(filepath.Join(chart.Dir(built.deploy), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	strict := 0
	var walk func(path string, s map[string]any, v any)
	walk = func(path string, s map[string]any, v any) {
		props, _ := s["properties"].(map[string]any)
		vm, isMap := v.(map[string]any)
		if s["additionalProperties"] == false {
			strict++
			if !isMap {
				t.Errorf("%s: the schema describes an object, values.yaml has %T", path, v)
				return
			}
			for _, k := range slices.Sorted(maps.Keys(props)) {
				if _, ok := vm[k]; !ok && !(path == "" && k == "global") {
					t.Errorf("values.schema.json has %s%s, which values.yaml does not", path, k)
				}
			}
			for _, k := range slices.Sorted(maps.Keys(vm)) {
				if _, ok := props[k]; !ok {
					t.Errorf("values.yaml has %s%s, which values.schema.json refuses", path, k)
				}
			}
		}
		for k, sub := range props {
			if sm, ok := sub.(map[string]any); ok && isMap {
				if vv, ok := vm[k]; ok {
					walk(path+k+".", sm, vv)
				}
			}
		}
	}
	walk("", schema, values)
	if strict < 5 {
		t.Errorf("the schema refuses unknown keys in %d objects; want at least the top, config and setupJob.config", strict)
	}
}

// config.header, a list, reaches the replicas as repeated --header flags: every header it names
// is on the messages they map, with the field of the device's value it names, and the setup Job
// gets the same list.
func TestChartHeadersReachTheReplicas(t *testing.T) {
	srv := natstest.Start(t)
	values := map[string]any{
		"replicaCount": 1,
		"config": map[string]any{
			"out":    "outgoing.{region}.{group}.{device}.{event}",
			"header": []any{"Tenant={tenant}", "Region={region}"},
		},
	}
	r := render(t, values)
	for what, c := range containers(t, r) {
		found := false
		for _, e := range c.Env {
			if e.Name == "KVMAPPER_HEADER" {
				found = true
				if e.Value != "Tenant={tenant},Region={region}" {
					t.Errorf("%s: KVMAPPER_HEADER=%q, want the list joined with commas", what, e.Value)
				}
			}
		}
		if !found {
			t.Errorf("%s: no KVMAPPER_HEADER", what)
		}
	}
	d := &deployment{t: t, r: r, servers: srv.ClientURL()}
	d.setup()
	d.replicas()
	d.owned(16)

	_, js := srv.JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	groups, err := js.KeyValue(ctx, "device-groups")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := groups.PutString(ctx, "dev-7", `{"group":"g1","region":"eu","tenant":"acme"}`); err != nil {
		t.Fatal(err)
	}
	// The replica applies the value through its watch; a message published before that is a
	// dead letter, so publish until one is mapped.
	out, err := js.Stream(ctx, "OUTGOING")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, func() error {
		if _, err := js.Publish(ctx, "incoming.dev-7.temp", []byte("21.5")); err != nil {
			return err
		}
		m, err := out.GetLastMsgForSubject(ctx, "outgoing.eu.g1.dev-7.temp")
		if err != nil {
			return fmt.Errorf("no message on outgoing.eu.g1.dev-7.temp yet: %w", err)
		}
		if got := m.Header.Get("Tenant"); got != "acme" {
			return fmt.Errorf("Tenant header %q, want acme (headers %v)", got, m.Header)
		}
		if got := m.Header.Get("Region"); got != "eu" {
			return fmt.Errorf("Region header %q, want eu (headers %v)", got, m.Header)
		}
		return nil
	})
	d.stop()
}
