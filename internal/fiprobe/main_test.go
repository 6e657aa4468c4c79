package fiprobe_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// wait bounds every answer a probe waits for: on a loaded 2-core machine answers take
// milliseconds, never seconds.
const wait = 10 * time.Second

// outgoing starts a server (its options changed by mods) and creates OUTGOING as a batched
// write path would want it: file storage, outgoing.>, a 2-minute duplicate window and
// allow_batched; cfg may change it further.
func outgoing(t *testing.T, cfg func(*jetstream.StreamConfig), mods ...func(*server.Options)) (*natstest.Server, *nats.Conn, jetstream.JetStream) {
	t.Helper()
	s := natstest.Start(t, mods...)
	nc, js := s.JetStream(t)
	createOutgoing(t, js, 1, cfg)
	return s, nc, js
}

func createOutgoing(t testing.TB, js jetstream.JetStream, replicas int, cfg func(*jetstream.StreamConfig)) {
	t.Helper()
	c := jetstream.StreamConfig{
		Name: "OUTGOING", Subjects: []string{"outgoing.>"}, Storage: jetstream.FileStorage,
		Duplicates: 2 * time.Minute, AllowBatchPublish: true, Replicas: replicas,
	}
	if cfg != nil {
		cfg(&c)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, c); err != nil {
		t.Fatalf("CreateStream %s: %v", c.Name, err)
	}
}

// stored returns the Nats-Msg-Id of every message stream holds, in stream order.
func stored(t *testing.T, js jetstream.JetStream, stream string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("Stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatalf("Info %s: %v", stream, err)
	}
	var ids []string
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("GetMsg %s %d: %v", stream, seq, err)
		}
		ids = append(ids, m.Header.Get(nats.MsgIdHdr))
	}
	return ids
}

// ids returns "<prefix><i>" for i in from..to.
func ids(prefix string, from, to int) []string {
	var s []string
	for i := from; i <= to; i++ {
		s = append(s, prefix+strconv.Itoa(i))
	}
	return s
}

func sameIDs(t *testing.T, what string, got, want []string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Fatalf("%s: stored %v, want %v", what, got, want)
	}
}

// publish stores msgs with plain (non-batched) publishes, waiting for each PubAck.
func publish(t *testing.T, js jetstream.JetStream, msgs ...*nats.Msg) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for _, m := range msgs {
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatalf("PublishMsg %s: %v", m.Subject, err)
		}
	}
}

func errCode(a answer) string {
	if a.Error == nil {
		return "none"
	}
	return fmt.Sprintf("%d/%d %q", a.Error.Code, a.Error.ErrorCode, a.Error.Description)
}
