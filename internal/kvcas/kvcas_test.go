package kvcas_test

import (
	"context"
	"errors"
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

// The same on a replicated bucket, where nats.go documents another code (10164) for the conflict.
// nats-server 2.15.2 answered both writes here with 10071: this test passes without IsConflict's
// check of 10164, which stands on nats.go's documentation alone.
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
		if !kvcas.IsConflict(err) {
			t.Errorf("%s on R3: IsConflict(%v) = false, want true", name, err)
		}
	}
}
