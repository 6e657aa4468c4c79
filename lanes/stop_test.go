package lanes_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// TestConsumerOfAStoppedServerIsReplacedAtOnce runs one lane on a 3-node cluster, its messages
// published at 200 a second, with its consumer on a server other than the one its connection
// goes to, and OUTGOING led by that server as well, and stops that server gracefully (SIGTERM:
// nats-server's Shutdown). The lane must notice at once — the server tells the pending pull
// requests of its consumers "409 Server Shutdown" before it goes, and OUTGOING's new leader is
// announced — and go on from a consumer on another server, resending what the old leader
// dropped: no message may wait more than a second between INCOMING and OUTGOING (a missed
// heartbeat alone takes 1s to notice, a consumer placed on the stopping server again 2s more, the
// delete of the old consumer 2s, a read of the stream's incarnation 5s, a publish the old leader
// dropped the stall timeout of 2s).
func TestConsumerOfAStoppedServerIsReplacedAtOnce(t *testing.T) {
	// Not parallel: its bound is the target itself (1 s), so it runs before the parallel tests,
	// the only one of its package then.
	for _, sl := range []subjects.StreamLayout{subjects.SingleStream, subjects.PartitionStreams} {
		t.Run(string(sl), func(t *testing.T) { consumerOfAStoppedServer(t, sl) })
	}
}

func consumerOfAStoppedServer(t *testing.T, sl subjects.StreamLayout) {
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		t.Fatal(err)
	}
	var mods []func(*server.Options)
	if sl == subjects.PartitionStreams {
		// Each server gets the account mapping, as its configuration file would give it.
		mods = append(mods, func(o *server.Options) {
			acc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
			if err := acc.AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
				t.Fatal(err)
			}
			o.Accounts = []*server.Account{acc}
		})
	}
	c := natstest.StartCluster(t, 3, mods...)
	nc := c.Connect(t, 0, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectBufSize(-1))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	names := subjects.Names{StreamLayout: sl}.WithDefaults()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// A cluster just started may answer a first read of a new bucket with "no responders".
	natstest.Eventually(t, 30*time.Second, func() error {
		_, err := setup.Ensure(ctx, js, setup.Config{Layout: lay, Names: names, Replicas: 3})
		return err
	})
	ctl, err := js.KeyValue(ctx, names.Control)
	if err != nil {
		t.Fatal(err)
	}
	dev := "dev-s"
	p := subjects.Partition(dev, lay.Partitions)
	stream, _ := names.IncomingStream(lay, p)
	g := &groups{m: map[string]string{dev: "g"}}
	cfg := lanes.Config{Layout: lay, Incoming: names.Incoming, StreamLayout: sl, Outgoing: names.Outgoing, Unmapped: names.Unmapped}
	if os.Getenv("KVMAPPER_TEST_LOG") != "" {
		lvl, _ := zerolog.ParseLevel(os.Getenv("KVMAPPER_TEST_LOG"))
		cfg.Logger = zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr}).Level(lvl).With().Timestamp().Logger()
	}
	pool, err := lanes.New(js, ctl, g.lookup, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 1})

	// The devices' side: 200 messages a second, each retried until INCOMING takes it.
	pnc := c.Connect(t, 0, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	pjs, err := jetstream.New(pnc)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	done := make(chan int)
	go func() {
		n := 0
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				done <- n
				return
			case <-tick.C:
			}
			for {
				pctx, pcancel := context.WithTimeout(context.Background(), time.Second)
				_, err := pjs.Publish(pctx, "incoming."+dev+".t", []byte(strconv.Itoa(n)), jetstream.WithMsgID(strconv.Itoa(n)))
				pcancel()
				if err == nil {
					break
				}
			}
			n++
		}
	}()

	// Its consumer on n1 or n2: deleted until the lane creates it there.
	host := func() (string, string) {
		st, err := js.Stream(ctx, stream)
		if err != nil {
			return "", ""
		}
		lister := st.ListConsumers(ctx)
		for ci := range lister.Info() {
			if strings.HasPrefix(ci.Name, "kvmapper_"+strconv.Itoa(p)+"_") && ci.Cluster != nil {
				return ci.Name, ci.Cluster.Leader
			}
		}
		return "", ""
	}
	var on string
	natstest.Eventually(t, 30*time.Second, func() error {
		name, leader := host()
		switch {
		case name == "":
			return fmt.Errorf("no consumer of the lane yet")
		case leader == c.Name(0):
			_ = js.DeleteConsumer(ctx, stream, name)
			return fmt.Errorf("the lane's consumer is on %s, the server of its connection", leader)
		}
		on = leader
		return nil
	})
	// OUTGOING led by that server too: its publishes in flight are dropped with the handover.
	if c.StreamLeader(names.Outgoing) != c.Index(on) {
		c.StepDownTo(nc, names.Outgoing, c.Index(on))
	}
	// Two seconds of mapping before, two after.
	<-time.After(2 * time.Second)
	stopped := time.Now()
	c.Stop(c.Index(on))
	t.Logf("stopped %s, which held the lane's consumer", on)
	<-time.After(2 * time.Second)
	close(stop)
	n := <-done

	// Every message, in order; and how long each waited.
	in, out := streamTimes(t, js, stream, n), streamTimes(t, js, names.Outgoing, n)
	var worst time.Duration
	var at time.Time
	for i := range n {
		if d := out[i].Sub(in[i]); d > worst {
			worst, at = d, in[i]
		}
	}
	t.Logf("%d messages; the longest wait between INCOMING and OUTGOING %v, of a message stored %v after the stop",
		n, worst.Round(time.Millisecond), at.Sub(stopped).Round(time.Millisecond))
	if worst > time.Second {
		t.Errorf("a message waited %v between INCOMING and OUTGOING, want at most 1s", worst)
	}
}

// streamTimes reads the n messages of stream (payloads 0…n-1, in order) and returns when each
// was stored, by payload.
func streamTimes(t *testing.T, js jetstream.JetStream, stream string, n int) []time.Time {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	times := make([]time.Time, n)
	natstest.Eventually(t, 30*time.Second, func() error {
		cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{FilterSubjects: []string{"*.>"}})
		if err != nil {
			return err
		}
		got := 0
		for got < n {
			b, err := cons.Fetch(n-got, jetstream.FetchMaxWait(2*time.Second))
			if err != nil {
				return err
			}
			k := 0
			for m := range b.Messages() {
				if strings.HasPrefix(m.Subject(), subjects.FencePrefix+".") {
					continue
				}
				if string(m.Data()) != strconv.Itoa(got) {
					t.Fatalf("%s: message %d is %q, want %q", stream, got, m.Data(), strconv.Itoa(got))
				}
				md, err := m.Metadata()
				if err != nil {
					return err
				}
				times[got] = md.Timestamp
				got++
				k++
			}
			if k == 0 {
				return fmt.Errorf("%s holds %d of %d messages", stream, got, n)
			}
		}
		return nil
	})
	return times
}
