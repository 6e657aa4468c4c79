package subjects_test

import (
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvmapper/kvmapper/subjects"
)

// TestPartitionVectors uses the vectors of TestSubjectTransforms in nats-server's
// subject_transform_test.go. The server's shorthand {{partition(n)}} hashes the whole subject with
// its dots, and {{partition(n,1,2)}} hashes the tokens concatenated with no separator.
func TestPartitionVectors(t *testing.T) {
	tests := []struct {
		key  string
		n    int
		want int
	}{
		{"foo", 10, 3},
		{"baz", 10, 0},
		{"qux", 10, 9},
		{"foo.bar", 10, 6},
		{"foo.baz", 10, 4},
		{"test.subject", 5, 0},
		{"baz", 0, 0},
		{"anything", 1, 0},
	}
	for _, tt := range tests {
		t.Run(tt.key+"/"+strconv.Itoa(tt.n), func(t *testing.T) {
			if got := subjects.Partition(tt.key, tt.n); got != tt.want {
				t.Fatalf("Partition(%q, %d) = %d, want %d", tt.key, tt.n, got, tt.want)
			}
		})
	}
}

// TestPartitionConcatenated checks that several tokens hash as their concatenation, as the server's
// {{partition(n,1,2)}} does.
func TestPartitionConcatenated(t *testing.T) {
	tr, err := server.NewSubjectTransform("*.*", "{{partition(10,1,2)}}")
	if err != nil {
		t.Fatalf("NewSubjectTransform() = %v", err)
	}
	got, err := tr.Match("foo.bar")
	if want := strconv.Itoa(subjects.Partition("foobar", 10)); err != nil || got != want {
		t.Fatalf("server Match(foo.bar) = %q, %v; want Partition(foobar, 10) = %q", got, err, want)
	}
}

// TestPartitionMatchesServer runs the server's own transform, built from TransformSource and
// TransformDest, over thousands of random device tokens and compares it with StoredSubject,
// Partition and Parse.
func TestPartitionMatchesServer(t *testing.T) {
	layouts := []struct{ in, out, unmapped string }{
		{defIn, defOut, defUnmapped},
		{"a.b.{site}.x.{device}", "o.{group}.{device}", "u.{device}"},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, lt := range layouts {
		for _, p := range []int{1, 2, 7, 16, 100, 1024} {
			t.Run(lt.in+"/"+strconv.Itoa(p), func(t *testing.T) {
				l, err := subjects.NewLayout(lt.in, lt.out, lt.unmapped, p)
				if err != nil {
					t.Fatalf("NewLayout() = %v", err)
				}
				tr, err := server.NewSubjectTransform(l.TransformSource(), l.TransformDest())
				if err != nil {
					t.Fatalf("NewSubjectTransform(%q, %q) = %v", l.TransformSource(), l.TransformDest(), err)
				}
				var f subjects.Fields
				for range 2000 {
					values := map[string]string{}
					for _, name := range l.In.Placeholders() {
						values[name] = randomToken(rng)
					}
					pub, err := l.In.Render(values)
					if err != nil {
						t.Fatalf("Render(%v) = %v", values, err)
					}
					got, err := tr.Match(pub)
					if err != nil {
						t.Fatalf("server Match(%q) = %v", pub, err)
					}
					want, err := l.StoredSubject(values)
					if err != nil || got != want {
						t.Fatalf("server stored %q, StoredSubject(%v) = %q, %v", got, values, want, err)
					}
					if err := l.Parse(got, &f); err != nil {
						t.Fatalf("Parse(%q) = %v", got, err)
					}
					if f.Device() != values["device"] || f.Partition() != subjects.Partition(values["device"], p) {
						t.Fatalf("Parse(%q): Device() = %q, Partition() = %d; want %q, %d",
							got, f.Device(), f.Partition(), values["device"], subjects.Partition(values["device"], p))
					}
				}
			})
		}
	}
}

// randomToken returns a valid token of 1 to 40 runes drawn from ASCII and a few multi-byte runes.
func randomToken(rng *rand.Rand) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_:@#$%+=!~"
	extra := []rune{'é', 'ß', '日', '本', '🙂'}
	var b strings.Builder
	for range 1 + rng.IntN(40) {
		if rng.IntN(8) == 0 {
			b.WriteRune(extra[rng.IntN(len(extra))])
		} else {
			b.WriteByte(alphabet[rng.IntN(len(alphabet))])
		}
	}
	return b.String()
}
