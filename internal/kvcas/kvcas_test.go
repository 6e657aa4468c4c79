package kvcas_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/kvcas"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// Every way kvmapper writes with compare-and-set, failing against a real server.
func TestIsConflict(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b"})
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Create(ctx, "k", []byte("1"))
	if err != nil {
		t.Fatal(err)
	}
	_, createErr := kv.Create(ctx, "k", []byte("2"))
	_, updateErr := kv.Update(ctx, "k", []byte("2"), rev+7)
	deleteErr := kv.Delete(ctx, "k", jetstream.LastRevision(rev+7))
	m := nats.NewMsg("$KV.b.k")
	_, pubErr := js.PublishMsg(ctx, m, jetstream.WithExpectLastSequencePerSubject(rev+7))
	_, getErr := kv.Get(ctx, "missing")
	for name, tc := range map[string]struct {
		err  error
		want bool
	}{
		"create of an existing key":            {createErr, true},
		"update at the wrong revision":         {updateErr, true},
		"delete at the wrong revision":         {deleteErr, true},
		"publish with the wrong last sequence": {pubErr, true},
		"get of a missing key":                 {getErr, false},
		"nil":                                  {nil, false},
		"another error":                        {errors.New("x"), false},
	} {
		if got := kvcas.IsConflict(tc.err); got != tc.want {
			t.Errorf("%s: IsConflict(%v) = %v, want %v", name, tc.err, got, tc.want)
		}
	}
}

// The same on a replicated bucket, and the other answer a replicated bucket gives: a write sent
// while another write of the same key is still being applied is refused with 10164 whatever
// revision it expects (nothing was written, the key holds what it held): in process, not a
// conflict. Two writes sent back to back on the key's revision meet it; the test sends pairs
// until one does (the first pair, nearly always).
func TestIsConflictReplicated(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	nc := c.Connect(t, 0)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", Replicas: 3})
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Create(ctx, "k", []byte("1"))
	if err != nil {
		t.Fatal(err)
	}
	_, updateErr := kv.Update(ctx, "k", []byte("2"), rev+7)
	_, pubErr := js.PublishMsg(ctx, nats.NewMsg("$KV.b.k"), jetstream.WithExpectLastSequencePerSubject(rev+7))
	for name, err := range map[string]error{"update at the wrong revision": updateErr, "publish with the wrong last sequence": pubErr} {
		if !kvcas.IsConflict(err) || kvcas.InProcess(err) {
			t.Errorf("%s on R3: IsConflict(%v) = %v, InProcess = %v; want true, false", name, err, kvcas.IsConflict(err), kvcas.InProcess(err))
		}
	}

	for i := 0; ; i++ {
		ent, err := kv.Get(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		var futs []jetstream.PubAckFuture
		for range 2 {
			f, err := js.PublishMsgAsync(nats.NewMsg("$KV.b.k"), jetstream.WithExpectLastSequencePerSubject(ent.Revision()))
			if err != nil {
				t.Fatal(err)
			}
			futs = append(futs, f)
		}
		var second error
		for j, f := range futs {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				if j == 0 {
					t.Fatalf("the first write on revision %d: %v", ent.Revision(), err)
				}
				second = err
			case <-ctx.Done():
				t.Fatal("no answer to a write")
			}
		}
		if kvcas.InProcess(second) {
			if kvcas.IsConflict(second) {
				t.Errorf("IsConflict(%v) = true for a write refused while another was in process, want false", second)
			}
			_, kvErr := kv.Update(ctx, "k", []byte("x"), 0)
			t.Logf("pair %d: the second write was refused as in process (%v); a conflict is %v", i, second, kvErr)
			return
		}
		if !kvcas.IsConflict(second) {
			t.Fatalf("the second write on revision %d: %v, want a conflict or in process", ent.Revision(), second)
		}
		if i == 20 {
			t.Fatalf("20 pairs of writes, none refused as in process")
		}
	}
}

// Latest, read right after each of many acknowledged writes to an R3 bucket under a load of
// other writes, always shows the write just acknowledged, delete markers and expiry markers as
// deleted, and a key never written as ErrNotFound. A KV Get (a direct get, answered by any
// replica) of the same key from a follower's node is counted for comparison: under load it shows
// an older revision now and then.
func TestLatestReadsTheLeader(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, err := jetstream.New(c.Connect(t, 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", Replicas: 3, History: 1, LimitMarkerTTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	leader := c.WaitStreamLeader("KV_b", -1, 30*time.Second)
	js, err := jetstream.New(c.Connect(t, (leader+1)%3))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kvcas.Latest(ctx, js, "b", "never"); !errors.Is(err, kvcas.ErrNotFound) {
		t.Errorf("Latest(never written) = %v, want ErrNotFound", err)
	}

	// The load: about 5,000 writes a second to other keys, from the leader's node.
	load, err := jetstream.New(c.Connect(t, leader))
	if err != nil {
		t.Fatal(err)
	}
	loadCtx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; loadCtx.Err() == nil; i++ {
			select {
			case <-tick.C:
			case <-loadCtx.Done():
				return
			}
			for j := range 50 {
				if _, err := load.PublishAsync("$KV.b.load."+strconv.Itoa(j), []byte("x")); err != nil {
					return
				}
			}
		}
	})
	defer func() { stopLoad(); wg.Wait() }()
	stale, n := 0, 0
	// 200 writes, or as many as 20s allow on a loaded machine.
	for start := time.Now(); n < 200 && time.Since(start) < 20*time.Second; n++ {
		i := n
		rev, err := kv.Put(ctx, "k", []byte(strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		m, err := kvcas.Latest(ctx, js, "b", "k")
		if err != nil {
			t.Fatalf("Latest(k) after write %d: %v", i, err)
		}
		if m.Sequence != rev || string(m.Data) != strconv.Itoa(i) || kvcas.Deleted(m) {
			t.Fatalf("Latest(k) = revision %d %q, want revision %d %q, just acknowledged", m.Sequence, m.Data, rev, strconv.Itoa(i))
		}
		if e, err := kv.Get(ctx, "k"); err == nil && e.Revision() != rev {
			stale++
		}
	}
	t.Logf("%d of %d KV Gets from a follower's node right after the write showed an older revision", stale, n)

	if err := kv.Delete(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if m, err := kvcas.Latest(ctx, js, "b", "k"); err != nil || !kvcas.Deleted(m) {
		t.Errorf("Latest(deleted k) = %v, %v; want a delete marker", m, err)
	}
	if _, err := kv.Create(ctx, "ttl", []byte("x"), jetstream.KeyTTL(time.Second)); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 10*time.Second, func() error {
		m, err := kvcas.Latest(ctx, js, "b", "ttl")
		if err != nil {
			return err
		}
		if !kvcas.Deleted(m) {
			return fmt.Errorf("Latest(ttl) = %q with headers %v, want its expiry marker", m.Data, m.Header)
		}
		return nil
	})
}

// AtSeq shows the headers of a revision, which KV reads leave out, and ErrNotFound for a
// revision no longer held.
func TestAtSeq(t *testing.T) {
	_, js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", History: 1})
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg("$KV.b.k")
	m.Data = []byte("v1")
	m.Header.Set("X-Test", "one")
	first, err := js.PublishMsg(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	got, err := kvcas.AtSeq(ctx, js, "KV_b", first.Sequence)
	if err != nil || string(got.Data) != "v1" || got.Header.Get("X-Test") != "one" || got.Sequence != first.Sequence {
		t.Fatalf("AtSeq(%d) = %+v, %v; want v1 with its header", first.Sequence, got, err)
	}
	if _, err := kv.PutString(ctx, "k", "v2"); err != nil { // history 1: the first is gone
		t.Fatal(err)
	}
	if _, err := kvcas.AtSeq(ctx, js, "KV_b", first.Sequence); !errors.Is(err, kvcas.ErrNotFound) {
		t.Errorf("AtSeq(a revision replaced) = %v, want ErrNotFound", err)
	}
}
