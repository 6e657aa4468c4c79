package kv_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

const wait = 10 * time.Second

// createBucket creates the device-groups bucket, retrying while the server answers 10049.
//
// The tests that delete the bucket and create it again hit a race in nats-server 2.15 that only
// an account holding a single stream can: deleting a stream's store starts a goroutine that
// removes the account's streams directory "if empty" (stream.go, mset.stop), and it can remove
// the directory the new stream has just made, so the create fails with "error creating store for
// stream" (err_code 10049) and nothing is created. Production accounts hold INCOMING and the
// other streams beside the bucket, so the directory is never empty there.
const errCodeStreamStoreFailed jetstream.ErrorCode = 10049

func createBucket(t testing.TB, js jetstream.JetStream) jetstream.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		b, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "device-groups"})
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeStreamStoreFailed {
			select {
			case <-ctx.Done():
				t.Fatalf("CreateKeyValue: %v (still failing after %v)", err, wait)
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		if err != nil {
			t.Fatalf("CreateKeyValue: %v", err)
		}
		return b
	}
}

// run starts tb.Run and registers a cleanup that cancels it and checks it returned nil.
func run(t testing.TB, tb *kv.Table) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tb.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run() = %v, want nil", err)
			}
		case <-time.After(wait):
			t.Errorf("Run did not return within %v of cancel", wait)
		}
	})
}

func newTable(t testing.TB, b jetstream.KeyValue, cfg kv.Config) *kv.Table {
	t.Helper()
	tb, err := kv.New(b, cfg)
	if err != nil {
		t.Fatalf("kv.New: %v", err)
	}
	return tb
}

func waitReady(t testing.TB, tb *kv.Table) {
	t.Helper()
	select {
	case <-tb.Ready():
	case <-time.After(wait):
		t.Fatalf("Ready not closed within %v", wait)
	}
}

func put(t testing.TB, b jetstream.KeyValue, key, value string) uint64 {
	t.Helper()
	rev, err := b.PutString(context.Background(), key, value)
	if err != nil {
		t.Fatalf("Put(%s): %v", key, err)
	}
	return rev
}

// sameEntry reports whether got is want: the same group, revision and validity, the reason when
// want names one, and, for a valid entry of the default schema, Values holding the group alone.
func sameEntry(got, want kv.Entry) bool {
	if got.Group != want.Group || got.Revision != want.Revision || got.Invalid != want.Invalid {
		return false
	}
	if want.Reason != "" && (got.Reason != want.Reason || got.Field != want.Field) {
		return false
	}
	if got.Invalid {
		return got.Values == (subjects.Values{}) && got.Reason != "" && got.Detail != ""
	}
	return got.Values.Get(0) == got.Group && got.Reason == "" && got.Detail == ""
}

// hasEntry returns nil once Lookup(device) returns want (see sameEntry).
func hasEntry(tb *kv.Table, device string, want kv.Entry) func() error {
	return func() error {
		got, ok := tb.Lookup(device)
		if !ok || !sameEntry(got, want) {
			return fmt.Errorf("Lookup(%s) = %+v, %v; want %+v, true", device, got, ok, want)
		}
		return nil
	}
}

func absent(tb *kv.Table, device string) func() error {
	return func() error {
		if got, ok := tb.Lookup(device); ok {
			return fmt.Errorf("Lookup(%s) = %+v, true; want false", device, got)
		}
		return nil
	}
}

func TestNewNilBucket(t *testing.T) {
	if _, err := kv.New(nil, kv.Config{}); !errors.Is(err, kv.ErrInvalidConfig) {
		t.Fatalf("New(nil) error = %v, want ErrInvalidConfig", err)
	}
}

func TestReadyAfterInitialLoad(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	const n = 2000
	revs := make(map[string]uint64, n)
	for i := range n {
		dev := fmt.Sprintf("dev-%d", i)
		put(t, b, dev, "old")
		revs[dev] = put(t, b, dev, fmt.Sprintf("group-%d", i%7))
	}
	var initial, live int
	var mu sync.Mutex
	tb := newTable(t, b, kv.Config{OnUpdate: func(u kv.Update) {
		mu.Lock()
		defer mu.Unlock()
		if u.Initial {
			initial++
		} else {
			live++
		}
	}})
	run(t, tb)
	waitReady(t, tb)
	if got := tb.Len(); got != n {
		t.Fatalf("Len() = %d, want %d", got, n)
	}
	for i := range n {
		dev := fmt.Sprintf("dev-%d", i)
		want := kv.Entry{Group: fmt.Sprintf("group-%d", i%7), Revision: revs[dev]}
		if err := hasEntry(tb, dev, want)(); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := tb.Revision(), revs[fmt.Sprintf("dev-%d", n-1)]; got != want {
		t.Errorf("Revision() = %d, want %d", got, want)
	}
	mu.Lock()
	if initial != n || live != 0 {
		t.Errorf("OnUpdate initial, live = %d, %d; want %d, 0", initial, live, n)
	}
	mu.Unlock()
}

func TestReadyEmptyBucket(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	tb := newTable(t, createBucket(t, js), kv.Config{})
	run(t, tb)
	waitReady(t, tb)
	if got := tb.Len(); got != 0 {
		t.Errorf("Len() = %d, want 0", got)
	}
	if _, ok := tb.Lookup("dev-1"); ok {
		t.Errorf("Lookup(dev-1) ok = true, want false")
	}
}

func TestLiveChanges(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	tb := newTable(t, b, kv.Config{})
	run(t, tb)
	waitReady(t, tb)
	ctx := context.Background()

	rev := put(t, b, "dev-1", "group-a")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-a", Revision: rev}))
	rev = put(t, b, "dev-1", "group-b\n")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-b", Revision: rev}))
	rev = put(t, b, "dev-1", "group-c\r\n")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-c", Revision: rev}))
	if got := tb.Revision(); got != rev {
		t.Errorf("Revision() = %d, want %d", got, rev)
	}

	if err := b.Delete(ctx, "dev-1"); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	natstest.Eventually(t, wait, absent(tb, "dev-1"))

	rev = put(t, b, "dev-2", "group-a")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-2", kv.Entry{Group: "group-a", Revision: rev}))
	if err := b.Purge(ctx, "dev-2"); err != nil {
		t.Fatalf("Purge: %v", err)
	}
	natstest.Eventually(t, wait, absent(tb, "dev-2"))
	if got := tb.Len(); got != 0 {
		t.Errorf("Len() = %d, want 0", got)
	}
	// A deleted device can come back.
	rev = put(t, b, "dev-1", "group-d")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-d", Revision: rev}))
}

// syncBuffer is a bytes.Buffer safe for the watch goroutine to write while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestInvalidValues(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	var logs syncBuffer
	tb := newTable(t, b, kv.Config{Logger: zerolog.New(&logs)})
	run(t, tb)
	waitReady(t, tb)

	invalid := map[string]string{
		"dot":    "a.b",
		"star":   "*",
		"gt":     ">",
		"empty":  "",
		"long":   strings.Repeat("x", 300),
		"space":  "has space",
		"ws-nl":  "group-b \n",
		"ctrl":   "a\x01",
		"tab":    "\tgroup",
		"onlynl": "\n",
	}
	for dev, value := range invalid {
		rev := put(t, b, dev, value)
		natstest.Eventually(t, wait, hasEntry(tb, dev, kv.Entry{Revision: rev, Invalid: true, Reason: wire.ReasonInvalidGroup}))
	}
	if got := tb.Invalid(); got[wire.ReasonInvalidGroup] != len(invalid) || len(got) != 1 {
		t.Errorf("Invalid() = %v, want %s: %d", got, wire.ReasonInvalidGroup, len(invalid))
	}
	// An invalid device becomes valid again with a valid value.
	rev := put(t, b, "dot", "group-b\n")
	natstest.Eventually(t, wait, hasEntry(tb, "dot", kv.Entry{Group: "group-b", Revision: rev}))

	// Ten invalid values within a second log at most a couple of lines.
	if got := tb.Invalid(); got[wire.ReasonInvalidGroup] != len(invalid)-1 {
		t.Errorf("Invalid() = %v after one device was fixed, want %s: %d", got, wire.ReasonInvalidGroup, len(invalid)-1)
	}
	if n := strings.Count(logs.String(), "invalid device value"); n < 1 || n > 2 {
		t.Errorf("logged %d invalid-value lines, want 1 or 2 (rate-limited):\n%s", n, logs.String())
	}
}

func TestServerRestart(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	b := createBucket(t, js)
	rev := put(t, b, "dev-1", "group-a")
	tb := newTable(t, b, kv.Config{RetryMin: 20 * time.Millisecond, RetryMax: 200 * time.Millisecond, CheckInterval: 100 * time.Millisecond})
	run(t, tb)
	waitReady(t, tb)
	natstest.Eventually(t, wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-a", Revision: rev}))

	srv.Restart()
	// The table keeps serving while the client reconnects.
	if err := hasEntry(tb, "dev-1", kv.Entry{Group: "group-a", Revision: rev})(); err != nil {
		t.Fatalf("after restart: %v", err)
	}
	natstest.Eventually(t, 2*wait, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var err error
		rev, err = b.PutString(ctx, "dev-1", "group-b")
		return err
	})
	natstest.Eventually(t, 2*wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-b", Revision: rev}))
	rev2 := put(t, b, "dev-2", "group-c")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-2", kv.Entry{Group: "group-c", Revision: rev2}))
}

func TestBucketDeleted(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	rev1 := put(t, b, "dev-1", "group-a")
	put(t, b, "dev-2", "group-a")
	var logs syncBuffer
	tb := newTable(t, b, kv.Config{
		Logger:        zerolog.New(&logs),
		RetryMin:      10 * time.Millisecond,
		RetryMax:      50 * time.Millisecond,
		CheckInterval: 50 * time.Millisecond,
	})
	run(t, tb)
	waitReady(t, tb)

	ctx := context.Background()
	if err := js.DeleteKeyValue(ctx, "device-groups"); err != nil {
		t.Fatalf("DeleteKeyValue: %v", err)
	}
	natstest.Eventually(t, wait, func() error {
		if !strings.Contains(logs.String(), "nats kv add device-groups") {
			return fmt.Errorf("no error log with the fix yet: %s", logs.String())
		}
		return nil
	})
	// The last table is still served.
	if err := hasEntry(tb, "dev-1", kv.Entry{Group: "group-a", Revision: rev1})(); err != nil {
		t.Fatal(err)
	}

	// Recreated with other content: the table follows it and drops what is gone.
	b = createBucket(t, js)
	rev := put(t, b, "dev-3", "group-c")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-3", kv.Entry{Group: "group-c", Revision: rev}))
	natstest.Eventually(t, wait, absent(tb, "dev-1"))
	natstest.Eventually(t, wait, absent(tb, "dev-2"))
	if got := tb.Len(); got != 1 {
		t.Errorf("Len() = %d, want 1", got)
	}
	rev = put(t, b, "dev-1", "group-d")
	natstest.Eventually(t, wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-d", Revision: rev}))
}

// A bucket deleted and created again between two checks: nats.go's watcher would resume the new
// stream after the old one's last revision and skip everything below it.
func TestBucketRecreatedBetweenChecks(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	for i := 0; i < 20; i++ {
		put(t, b, "dev-"+strconv.Itoa(i), "group-old")
	}
	tb := newTable(t, b, kv.Config{RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, CheckInterval: 200 * time.Millisecond})
	run(t, tb)
	waitReady(t, tb)

	ctx := context.Background()
	if err := js.DeleteKeyValue(ctx, "device-groups"); err != nil {
		t.Fatalf("DeleteKeyValue: %v", err)
	}
	b = createBucket(t, js)
	rev := put(t, b, "dev-1", "group-new") // revision 1, far below the old stream's 20
	natstest.Eventually(t, wait, hasEntry(tb, "dev-1", kv.Entry{Group: "group-new", Revision: rev}))
	natstest.Eventually(t, wait, absent(tb, "dev-2"))
	if got := tb.Revision(); got != rev {
		t.Errorf("Revision() = %d after the recreate, want %d", got, rev)
	}
}

func TestRunTwice(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	tb := newTable(t, createBucket(t, js), kv.Config{})
	run(t, tb)
	waitReady(t, tb)
	if err := tb.Run(context.Background()); !errors.Is(err, kv.ErrRunning) {
		t.Fatalf("second Run() = %v, want ErrRunning", err)
	}
}

func TestRunConnectionClosed(t *testing.T) {
	srv := natstest.Start(t)
	nc, js := srv.JetStream(t)
	tb := newTable(t, createBucket(t, js), kv.Config{RetryMin: 10 * time.Millisecond})
	done := make(chan error, 1)
	go func() { done <- tb.Run(context.Background()) }()
	waitReady(t, tb)
	nc.Close()
	select {
	case err := <-done:
		if !errors.Is(err, nats.ErrConnectionClosed) {
			t.Fatalf("Run() = %v, want ErrConnectionClosed", err)
		}
	case <-time.After(wait):
		t.Fatalf("Run did not return within %v of the connection closing", wait)
	}
}
