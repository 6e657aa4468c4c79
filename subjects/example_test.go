package subjects_test

import (
	"fmt"

	"github.com/kvmapper/kvmapper/subjects"
)

func ExampleNewLayout() {
	l, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(l.StreamSubject())
	fmt.Println(l.TransformDest())
	fmt.Println(l.Filter(7))
	fmt.Println(l.OutStreamSubject(), l.UnmappedStreamSubject())
	fmt.Println(l.MalformedSubject())

	_, err = subjects.NewLayout("incoming.{device}.{event}", "incoming.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	fmt.Println(err)
	// Output:
	// incoming.*.*
	// incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}
	// incoming.7.>
	// outgoing.> unmapped.>
	// unmapped._malformed._malformed
	// subjects: invalid template: out stream subject "incoming.>" overlaps the INCOMING subjects "incoming.*.*", so republished messages would loop; give out a different first token
}

func ExampleLayout_Parse() {
	l, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		fmt.Println(err)
		return
	}
	// The server stored dev-42 under partition 5, Partition("dev-42", 16).
	var f subjects.Fields // reused for every message of a lane
	buf := make([]byte, 0, 128)
	if err := l.Parse("incoming.5.dev-42.temp", &f); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(f.Partition(), f.Device(), f.Value("event"))
	// The device's value in the groups bucket, decoded once when the table reads it.
	v, err := l.Schema().Decode([]byte("group-b"))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(string(l.AppendOut(buf[:0], &f, v)))
	fmt.Println(string(l.AppendUnmapped(buf[:0], &f)))

	fmt.Println(l.Parse("incoming.dev-42.temp", &f))
	// Output:
	// 5 dev-42 temp
	// outgoing.group-b.dev-42.temp
	// unmapped.dev-42.temp
	// subjects: malformed subject: "incoming.dev-42.temp": partition token "dev-42" is not a number from 0 to 15 (want incoming.<partition>.{device}.{event})
}

func ExamplePartition() {
	fmt.Println(subjects.Partition("foo", 10))
	fmt.Println(subjects.Partition("dev-42", 16))
	// Output:
	// 3
	// 5
}

func ExampleValidToken() {
	for _, group := range []string{"group-b", "héllo", "a.b", "*", "with space", ""} {
		fmt.Printf("%q: %v\n", group, subjects.ValidToken(group))
	}
	// Output:
	// "group-b": <nil>
	// "héllo": <nil>
	// "a.b": subjects: invalid token: "a.b" contains '.'
	// "*": subjects: invalid token: "*" contains '*'
	// "with space": subjects: invalid token: "with space" contains white space at byte 4
	// "": subjects: invalid token: empty
}
