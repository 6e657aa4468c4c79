package subjects_test

import (
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/subjects"
)

// metaLayout routes on three fields of the value and carries two of them, one twice, in headers.
func metaLayout(t testing.TB) *subjects.Layout {
	t.Helper()
	l, err := subjects.NewLayout(defIn, "outgoing.{region}.{tenant}.{group}.{device}.{event}", defUnmapped, 16)
	if err != nil {
		t.Fatal(err)
	}
	l, err = l.WithHeaders([]string{"Tenant={tenant}", "Site={region}/{site} ({device})", "Tier={tier}"})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestSchema(t *testing.T) {
	l := metaLayout(t)
	sc := l.Schema()
	want := []subjects.Field{
		{Name: "region", Subject: true, Headers: []string{"Site"}},
		{Name: "tenant", Subject: true, Headers: []string{"Tenant"}},
		{Name: "group", Subject: true},
		{Name: "site", Headers: []string{"Site"}},
		{Name: "tier", Headers: []string{"Tier"}},
	}
	got := sc.Fields()
	if len(got) != len(want) {
		t.Fatalf("Fields() = %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i].Name != want[i].Name || got[i].Subject != want[i].Subject || !slices.Equal(got[i].Headers, want[i].Headers) {
			t.Errorf("Fields()[%d] = %+v, want %+v", i, got[i], want[i])
		}
	}
	if sc.Group() != 2 || sc.Index("tier") != 4 || sc.Index("device") != -1 || sc.Index("nope") != -1 {
		t.Errorf("Group() = %d, Index(tier) = %d, Index(device) = %d, Index(nope) = %d; want 2, 4, -1, -1",
			sc.Group(), sc.Index("tier"), sc.Index("device"), sc.Index("nope"))
	}
	if def := defaultLayout(t).Schema(); !slices.Equal(def.Names(), []string{"group"}) || def.Group() != 0 || !def.Fields()[0].Subject {
		t.Errorf("default layout: Schema().Fields() = %+v, want group alone, as a subject token", def.Fields())
	}
	if l, err := subjects.NewLayout(defIn, "outgoing.{device}.{event}", defUnmapped, 16); err != nil || l.Schema().Len() != 0 || l.Schema().Group() != -1 {
		t.Errorf("out without value fields: %v, Schema().Len() = %d; want no field", err, l.Schema().Len())
	}
}

func TestDecode(t *testing.T) {
	meta := metaLayout(t).Schema()
	def := defaultLayout(t).Schema()
	full := `"region":"eu","tenant":"acme","group":"g7","site":"fra-2","tier":"gold"`
	tests := []struct {
		name   string
		schema *subjects.Schema
		value  string
		want   []string // the fields in order; nil when the value is refused
		err    error
		field  string // the field the error names
		why    string // substring of the error
	}{
		{"plain", def, "group-b", []string{"group-b"}, nil, "", ""},
		{"plain utf-8", def, "héllo", []string{"héllo"}, nil, "", ""},
		{"plain quoted is a token", def, `"g7"`, []string{`"g7"`}, nil, "", ""},
		{"plain number is a token", def, "7", []string{"7"}, nil, "", ""},
		{"plain with a dot", def, "a.b", nil, subjects.ErrInvalidToken, "", "contains '.'"},
		{"plain empty", def, "", nil, subjects.ErrInvalidToken, "", "empty"},
		{"plain with leading space then brace", def, ` {"group":"g"}`, nil, subjects.ErrInvalidToken, "", "white space"},
		{"json group only", def, `{"group":"g7"}`, []string{"g7"}, nil, "", ""},
		{"json other fields ignored", def, `{"group":"g7","region":"eu.west","x":{"y":[1,{"z":"}"}]}}`, []string{"g7"}, nil, "", ""},
		{"json white space", def, " {\n\t\"group\" : \"g7\" \r\n}\n"[1:], []string{"g7"}, nil, "", ""},
		{"json escapes", def, `{"gr\u006fup":"g\u00e9-\"7\""}`, []string{`gé-"7"`}, nil, "", ""},
		{"json integer", def, `{"group":42}`, []string{"42"}, nil, "", ""},
		{"json negative integer", def, `{"group":-3}`, []string{"-3"}, nil, "", ""},
		{"json minus zero", def, `{"group":-0}`, []string{"0"}, nil, "", ""},
		{"json true", def, `{"group":true}`, []string{"true"}, nil, "", ""},
		{"json false", def, `{"group":false}`, []string{"false"}, nil, "", ""},
		{"json all fields", meta, "{" + full + "}", []string{"eu", "acme", "g7", "fra-2", "gold"}, nil, "", ""},
		{"json header field with space inside", meta, `{"region":"eu","tenant":"acme","group":"g7","site":"fra 2","tier":"gold"}`,
			[]string{"eu", "acme", "g7", "fra 2", "gold"}, nil, "", ""},

		{"not json", def, `{"group":"g7"`, nil, subjects.ErrInvalidValue, "", "not valid JSON"},
		{"trailing garbage", def, `{"group":"g7"} x`, nil, subjects.ErrInvalidValue, "", "not valid JSON"},
		{"two objects", def, `{"group":"g7"}{}`, nil, subjects.ErrInvalidValue, "", "not valid JSON"},
		{"field twice", def, `{"group":"g7","group":"g8"}`, nil, subjects.ErrInvalidValue, "group", "appears twice"},
		{"field twice escaped", def, `{"group":"g7","\u0067roup":"g8"}`, nil, subjects.ErrInvalidValue, "group", "appears twice"},
		{"missing", def, `{"grp":"g7"}`, nil, subjects.ErrMissingField, "group", `no field "group", which the out template uses`},
		{"empty object", def, `{}`, nil, subjects.ErrMissingField, "group", "no field"},
		{"null", def, `{"group":null}`, nil, subjects.ErrMissingField, "group", "no field"},
		{"case matters", def, `{"Group":"g7"}`, nil, subjects.ErrMissingField, "group", "no field"},
		{"missing header field", meta, `{"region":"eu","tenant":"acme","group":"g7","site":"fra-2"}`, nil, subjects.ErrMissingField, "tier",
			`no field "tier", which header Tier uses`},
		{"plain where more is needed", meta, "g7", nil, subjects.ErrMissingField, "region", "not a JSON object"},
		{"dot in a subject field", meta, `{` + strings.Replace(full, `"eu"`, `"eu.west"`, 1) + `}`, nil, subjects.ErrInvalidField, "region",
			`field "region", which the out template and header Site use: "eu.west" contains '.'`},
		{"wildcard", def, `{"group":">"}`, nil, subjects.ErrInvalidField, "group", "contains '>'"},
		{"space in a subject field", def, `{"group":"g 7"}`, nil, subjects.ErrInvalidField, "group", "white space"},
		{"empty subject field", def, `{"group":""}`, nil, subjects.ErrInvalidField, "group", "empty"},
		{"too long token", def, `{"group":"` + strings.Repeat("x", 256) + `"}`, nil, subjects.ErrInvalidField, "group", "longer than 255"},
		{"escaped line break in a header", meta, `{` + strings.Replace(full, `"gold"`, `"go\nld"`, 1) + `}`, nil, subjects.ErrInvalidField, "tier", "control character"},
		{"header field with edge space", meta, `{` + strings.Replace(full, `"gold"`, `"gold "`, 1) + `}`, nil, subjects.ErrInvalidField, "tier", "white space"},
		{"empty header field", meta, `{` + strings.Replace(full, `"gold"`, `""`, 1) + `}`, nil, subjects.ErrInvalidField, "tier", "empty"},
		{"long header field", meta, `{` + strings.Replace(full, `"gold"`, `"`+strings.Repeat("g", 1025)+`"`, 1) + `}`, nil, subjects.ErrInvalidField, "tier", "longer than 1024"},
		{"object", def, `{"group":{"id":"g7"}}`, nil, subjects.ErrInvalidField, "group", "is an object"},
		{"array", def, `{"group":["g7"]}`, nil, subjects.ErrInvalidField, "group", "is an array"},
		{"fraction", def, `{"group":7.5}`, nil, subjects.ErrInvalidField, "group", "only integers"},
		{"exponent", def, `{"group":7e2}`, nil, subjects.ErrInvalidField, "group", "only integers"},
		{"escaped invalid token", def, `{"group":"a\u0000b"}`, nil, subjects.ErrInvalidField, "group", "control character"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, err := tt.schema.Decode([]byte(tt.value))
			if tt.err != nil {
				var ve *subjects.ValueError
				if !errors.Is(err, tt.err) || !errors.As(err, &ve) {
					t.Fatalf("Decode(%q) = %v, want a *ValueError wrapping %v", tt.value, err, tt.err)
				}
				if ve.Field != tt.field || !strings.Contains(err.Error(), tt.why) {
					t.Fatalf("Decode(%q) = field %q, %q; want field %q and an error saying %q", tt.value, ve.Field, err, tt.field, tt.why)
				}
				return
			}
			if err != nil {
				t.Fatalf("Decode(%q) = %v, want nil", tt.value, err)
			}
			if got := fields(v)[:tt.schema.Len()]; !slices.Equal(got, tt.want) {
				t.Fatalf("Decode(%q) = %q, want %q", tt.value, got, tt.want)
			}
		})
	}
}

func fields(v subjects.Values) []string {
	out := make([]string, v.Len())
	for i := range out {
		out[i] = v.Get(i)
	}
	return out
}

func TestValues(t *testing.T) {
	v := subjects.PackValues("eu", "", "acme")
	if got := fields(v); !slices.Equal(got, []string{"eu", "", "acme"}) {
		t.Fatalf("PackValues fields = %q", got)
	}
	if v.Get(-1) != "" || v.Get(3) != "" || (subjects.Values{}).Get(0) != "" || (subjects.Values{}).Len() != 0 {
		t.Error("Get out of range, or of the zero Values, is not empty")
	}
	if subjects.ValuesOf(v.String()) != v {
		t.Error("ValuesOf(v.String()) != v")
	}
	long := strings.Repeat("x", 300)
	if got := subjects.PackValues(long, "y").Get(1); got != "y" {
		t.Errorf("Get(1) after a 300-byte field = %q, want y", got)
	}
}

func TestHeaders(t *testing.T) {
	l := metaLayout(t)
	var f subjects.Fields
	if err := l.Parse("incoming.5.dev-42.temp", &f); err != nil {
		t.Fatal(err)
	}
	v, err := l.Schema().Decode([]byte(`{"group":"g7","tenant":"acme","region":"eu","site":"fra-2","tier":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := string(l.AppendOut(nil, &f, v)); got != "outgoing.eu.acme.g7.dev-42.temp" {
		t.Errorf("AppendOut = %q, want outgoing.eu.acme.g7.dev-42.temp", got)
	}
	// The parts that depend on the value alone are rendered once, when it is decoded; the same
	// fields packed without them render the same, step by step.
	if got := fields(v)[l.Schema().Len():]; !slices.Equal(got, []string{"outgoing.eu.acme.g7.", "eu/fra-2 ("}) {
		t.Errorf("rendered parts = %q, want the out template's prefix and the Site header's", got)
	}
	raw := subjects.PackValues(fields(v)[:l.Schema().Len()]...)
	if a, b := string(l.AppendOut(nil, &f, v)), string(l.AppendOut(nil, &f, raw)); a != b {
		t.Errorf("AppendOut with the rendered parts = %q, without = %q", a, b)
	}
	for i := range l.NumHeaders() {
		if a, b := string(l.AppendHeader(nil, i, &f, v)), string(l.AppendHeader(nil, i, &f, raw)); a != b {
			t.Errorf("AppendHeader(%d) with the rendered parts = %q, without = %q", i, a, b)
		}
	}
	// A field a rendered part holds is not stored again: its entry points into the part.
	all := subjects.PackValues(fields(v)...)
	if len(v.String()) >= len(all.String()) {
		t.Errorf("Values hold %d bytes, its entries packed one after the other %d: want fewer", len(v.String()), len(all.String()))
	}
	// Over 255 bytes, offsets take two bytes each.
	long := strings.Repeat("s", 300)
	w, err := l.Schema().Decode([]byte(`{"group":"g7","tenant":"acme","region":"eu","site":"` + long + `","tier":1}`))
	if err != nil || w.Get(3) != long || w.Get(2) != "g7" || string(l.AppendHeader(nil, 1, &f, w)) != "eu/"+long+" (dev-42)" {
		t.Errorf("a 300-byte field: %v, site %d bytes, group %q", err, len(w.Get(3)), w.Get(2))
	}
	for i, want := range []bool{true, false, true} { // a field alone; {device} needs the message; a field alone
		if got, ok := l.HeaderString(i, v); ok != want || ok && got != string(l.AppendHeader(nil, i, &f, v)) {
			t.Errorf("HeaderString(%d) = %q, %v; want %v and AppendHeader's value", i, got, ok, want)
		}
	}
	if got, ok := l.HeaderString(0, raw); !ok || got != "acme" {
		t.Errorf("HeaderString(0) of values without the rendered parts = %q, %v; want acme, true", got, ok)
	}
	if got := l.Headers(); !slices.Equal(got, []string{"Tenant={tenant}", "Site={region}/{site} ({device})", "Tier={tier}"}) {
		t.Errorf("Headers() = %q", got)
	}
	buf := make([]byte, 0, 256)
	if n := testing.AllocsPerRun(1000, func() {
		buf = l.AppendOut(buf[:0], &f, v)
		for i := range l.NumHeaders() {
			buf = l.AppendHeader(buf, i, &f, v)
		}
	}); n != 0 {
		t.Errorf("AppendOut + AppendHeader: %v allocs per run, want 0", n)
	}
	value := []byte(`{"group":"g7","tenant":"acme","region":"eu","site":"fra-2","tier":1,"x":[{"y":2}]}`)
	if n := testing.AllocsPerRun(1000, func() {
		var err error
		buf, err = l.Schema().Append(buf[:0], value)
		if err != nil {
			t.Fatal(err)
		}
	}); n != 0 && !raceEnabled {
		t.Errorf("Schema.Append: %v allocs per run, want 0", n)
	}
}

func TestWithHeaders(t *testing.T) {
	base := defaultLayout(t)
	for _, tt := range []struct {
		name  string
		specs []string
		why   string // substring of the error; "" means valid
	}{
		{"one", []string{"Tenant={tenant}"}, ""},
		{"constant", []string{"Source=kvmapper"}, ""},
		{"subject placeholders", []string{"Where={device}/{event}", "Group={group}"}, ""},
		{"unicode literal", []string{"X-Ort=Zürich {region}"}, ""},
		{"no equals", []string{"Tenant"}, "write Name={field}"},
		{"empty name", []string{"={tenant}"}, "name is empty"},
		{"colon in name", []string{"Ten:ant={tenant}"}, "printable ASCII"},
		{"space in name", []string{"Ten ant={tenant}"}, "printable ASCII"},
		{"nats prefix", []string{"nats-msg-id={tenant}"}, "keep for their own"},
		{"kvmapper prefix", []string{"KVMapper-Tenant={tenant}"}, "keep for their own"},
		{"empty template", []string{"Tenant="}, "empty"},
		{"edge space", []string{"Tenant= {tenant}"}, "white space"},
		{"unclosed", []string{"Tenant={tenant"}, "unmatched"},
		{"stray close", []string{"Tenant=x}"}, "unmatched"},
		{"bad name", []string{"Tenant={Tenant}"}, "not a placeholder"},
		{"nested", []string{"Tenant={{tenant}}"}, "not a placeholder"},
		{"dotted path", []string{"Floor={site.floor}"}, "not a placeholder"},
		{"control", []string{"Tenant=a\tb{tenant}"}, "control character"},
		{"partition", []string{"P={partition}"}, "{partition}"},
		{"same name", []string{"Tenant={tenant}", "tenant={group}"}, "same name"},
		{"too many", slices.Repeat([]string{"A={a}"}, subjects.MaxHeaders+1), "at most"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l, err := base.WithHeaders(tt.specs)
			if tt.why == "" {
				if err != nil || l.NumHeaders() != len(tt.specs) {
					t.Fatalf("WithHeaders(%q) = %v, want %d headers", tt.specs, err, len(tt.specs))
				}
				return
			}
			if !errors.Is(err, subjects.ErrInvalidTemplate) || !strings.Contains(err.Error(), tt.why) {
				t.Fatalf("WithHeaders(%q) = %v, want ErrInvalidTemplate saying %q", tt.specs, err, tt.why)
			}
		})
	}
	if base.NumHeaders() != 0 || base.Schema().Len() != 1 {
		t.Errorf("WithHeaders changed the layout it was called on")
	}
}

// FuzzDecode checks the decoder against encoding/json: a value it accepts holds exactly what
// encoding/json reads of the fields, rendered by the documented rules; a value it refuses as
// invalid is one encoding/json refuses too, or names a field twice.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{`{"group":"g7","region":"eu","site":"s1"}`, `{"group":7,"region":true,"site":-0}`, "g7", `{"group":"a\u00e9"}`,
		`{"group":null}`, `{"group":[1,"]"],"region":{"a":"}"}}`, `{"group":-0,"region":1e3}`, `{`, `{"group":"g","group":"h"}`,
		`{"region":"x","group":"\ud800","site":"y"}`} {
		f.Add(s)
	}
	// group and site in the subject, where they render as one part with the dot between them;
	// region in a header alone.
	l, err := subjects.NewLayout(defIn, "outgoing.{group}.{site}.{device}.{event}", defUnmapped, 16)
	if err != nil {
		f.Fatal(err)
	}
	if l, err = l.WithHeaders([]string{"Region={region}"}); err != nil {
		f.Fatal(err)
	}
	sc := l.Schema()
	f.Fuzz(func(t *testing.T, value string) {
		v, err := sc.Decode([]byte(value))
		if !strings.HasPrefix(value, "{") {
			if !errors.Is(err, subjects.ErrMissingField) {
				t.Fatalf("Decode(%q) = %v: a plain value lacks site and region", value, err)
			}
			return
		}
		var m map[string]any
		jerr := json.Unmarshal([]byte(value), &m)
		if errors.Is(err, subjects.ErrInvalidValue) {
			if jerr == nil && !strings.Contains(err.Error(), "twice") {
				t.Fatalf("Decode(%q) = %v, but encoding/json reads %v", value, err, m)
			}
			return
		}
		if jerr != nil {
			t.Fatalf("Decode(%q) = %v, %v; encoding/json refuses it: %v", value, fields(v), err, jerr)
		}
		if err != nil {
			return
		}
		for i, name := range sc.Names() {
			jv, ok := m[name]
			if !ok || jv == nil {
				t.Fatalf("Decode(%q) = %q, but encoding/json has no %s", value, fields(v), name)
			}
			var want string
			switch x := jv.(type) {
			case string:
				want = x
			case bool:
				want = strconv.FormatBool(x)
			case float64:
				want = v.Get(i) // checked here: an integer, as written
				if n, perr := strconv.ParseFloat(want, 64); perr != nil || n != x || strings.ContainsAny(want, ".eE+") {
					t.Fatalf("Decode(%q): %s = %q, encoding/json reads %v", value, name, want, x)
				}
			default:
				t.Fatalf("Decode(%q): %s = %q, but encoding/json reads a %T", value, name, v.Get(i), jv)
			}
			if got := v.Get(i); got != want {
				t.Fatalf("Decode(%q): %s = %q, encoding/json reads %q", value, name, got, want)
			}
		}
		group, site, region := v.Get(sc.Index("group")), v.Get(sc.Index("site")), v.Get(sc.Index("region"))
		if subjects.ValidToken(group) != nil || subjects.ValidToken(site) != nil {
			t.Fatalf("Decode(%q): group %q or site %q is not a valid token", value, group, site)
		}
		var fl subjects.Fields
		if err := l.Parse("incoming.3.d.e", &fl); err != nil {
			t.Fatal(err)
		}
		wantOut := "outgoing." + group + "." + site + ".d.e"
		for _, w := range []subjects.Values{v, subjects.PackValues(fields(v)[:sc.Len()]...)} {
			if a, b := string(l.AppendOut(nil, &fl, w)), string(l.AppendHeader(nil, 0, &fl, w)); a != wantOut || b != region {
				t.Fatalf("Decode(%q): %q renders %q and Region %q, want %q and %q", value, w.String(), a, b, wantOut, region)
			}
		}
	})
}

func TestDescribe(t *testing.T) {
	def := defaultLayout(t).Schema()
	if got := def.Example(); got != "group-a" {
		t.Errorf("default Example() = %q, want group-a", got)
	}
	if got := def.Describe(); !strings.Contains(got, "a group (one subject token)") {
		t.Errorf("default Describe() = %q", got)
	}
	meta := metaLayout(t).Schema()
	ex := meta.Example()
	if _, err := meta.Decode([]byte(ex)); err != nil {
		t.Errorf("Example() = %s, which Decode refuses: %v", ex, err)
	}
	want := `a JSON object with "region" (a subject token: the out template and header Site), "tenant" (a subject token: the out template and header Tenant), ` +
		`"group" (a subject token: the out template), "site" (a header value: header Site), "tier" (a header value: header Tier); other fields are ignored`
	if got := meta.Describe(); got != want {
		t.Errorf("Describe() = %q\nwant %q", got, want)
	}
}

// BenchmarkRender renders a message's subject and output headers: the default templates with a
// group, and three fields of a JSON value in the subject with one of them in a header.
//
//	go test -run '^$' -bench Render ./subjects/
func BenchmarkRender(b *testing.B) {
	three, err := subjects.NewLayout(defIn, "outgoing.{region}.{tenant}.{group}.{device}.{event}", defUnmapped, 16)
	if err != nil {
		b.Fatal(err)
	}
	if three, err = three.WithHeaders([]string{"Tenant={tenant}"}); err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		lay   *subjects.Layout
		value string
	}{
		{"group", defaultLayout(b), "group-42"},
		{"three-fields", three, `{"group":"group-42","region":"region-2","tenant":"tenant-7"}`},
	} {
		b.Run(c.name, func(b *testing.B) {
			var f subjects.Fields
			if err := c.lay.Parse("incoming.7.dev-0000042.temp", &f); err != nil {
				b.Fatal(err)
			}
			v, err := c.lay.Schema().Decode([]byte(c.value))
			if err != nil {
				b.Fatal(err)
			}
			buf := make([]byte, 0, 256)
			b.ReportAllocs()
			for b.Loop() {
				buf = c.lay.AppendOut(buf[:0], &f, v)
				for h := range c.lay.NumHeaders() {
					buf = c.lay.AppendHeader(buf, h, &f, v)
				}
			}
		})
	}
}

func TestMapping(t *testing.T) {
	if m := (subjects.Mapping{Values: subjects.PackValues("g"), Revision: 3}); !m.Mapped() || m.Reason() != "" || m.Field() != "" || m.Detail() != "" {
		t.Errorf("a mapped Mapping reports reason %q, field %q, detail %q", m.Reason(), m.Field(), m.Detail())
	}
	m := subjects.Unmappable("missing-field", "region", "no field", 7)
	if m.Mapped() || m.Reason() != "missing-field" || m.Field() != "region" || m.Detail() != "no field" || m.Revision != 7 {
		t.Errorf("Unmappable = %v %q %q %q %d", m.Mapped(), m.Reason(), m.Field(), m.Detail(), m.Revision)
	}
	if f := subjects.Faulted(string(subjects.AppendFault(nil, "invalid-value", "", "not JSON")), 2); f.Reason() != "invalid-value" || f.Field() != "" || f.Detail() != "not JSON" {
		t.Errorf("Faulted = %q %q %q", f.Reason(), f.Field(), f.Detail())
	}
	if n := subjects.Unmappable("no-mapping", "", "", 0); n.Mapped() || n.Reason() != "no-mapping" || n.Field() != "" || n.Detail() != "" {
		t.Errorf("Unmappable(no-mapping) = %q %q %q", n.Reason(), n.Field(), n.Detail())
	}
}
