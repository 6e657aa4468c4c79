package embedded_test

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/embedded"
)

// A started server accepts clients on its URL, has JetStream, and applies the mappings it was
// started with and those added later.
func TestStartMapsAndHasJetStream(t *testing.T) {
	srv, err := embedded.Start(embedded.Config{Listen: "127.0.0.1:-1", Dir: t.TempDir(), Mappings: map[string]string{"a.*": "mapped.a.{{wildcard(1)}}"}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if err := srv.AddMapping("b.*", "mapped.b.{{wildcard(1)}}"); err != nil {
		t.Fatal(err)
	}
	sub, err := nc.SubscribeSync("mapped.>")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"a.1", "b.2"} {
		if err := nc.Publish(s, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range []string{"mapped.a.1", "mapped.b.2"} {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil || m.Subject != want {
			t.Fatalf("NextMsg() = %v, %v; want a message on %s", m, err, want)
		}
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.AccountInfo(t.Context()); err != nil {
		t.Fatalf("AccountInfo() = %v: JetStream is off", err)
	}
}

func TestStartRefusesABadListenAddress(t *testing.T) {
	for _, l := range []string{"4222", "127.0.0.1:x", "127.0.0.1:70000"} {
		if _, err := embedded.Start(embedded.Config{Listen: l, Dir: t.TempDir()}); !errors.Is(err, embedded.ErrInvalidListen) {
			t.Errorf("Start(Listen %q) = %v, want ErrInvalidListen", l, err)
		}
	}
}
