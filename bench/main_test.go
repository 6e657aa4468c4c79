package bench_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"
	"golang.org/x/sync/errgroup"

	"github.com/kvmapper/kvmapper/bench"
	"github.com/kvmapper/kvmapper/election"
	"github.com/kvmapper/kvmapper/kv"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// childEnv, when set, makes the test binary a kvmapper replica process for the failover bench:
// it holds the JSON of a childArgs.
const childEnv = "KVMAPPER_BENCH_TEST_CHILD"

type childArgs struct {
	URL   string
	ID    string
	Names bench.Names
}

func TestMain(m *testing.M) {
	if a := os.Getenv(childEnv); a != "" {
		os.Exit(runChild(a))
	}
	goleak.VerifyTestMain(m)
}

func runChild(arg string) int {
	var a childArgs
	if err := json.Unmarshal([]byte(arg), &a); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := testReplica(ctx, a.URL, a.ID, a.Names, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// testChild runs a replica as a child process: this test binary, re-executed.
func testChild(url, id string, n bench.Names) *exec.Cmd {
	b, err := json.Marshal(childArgs{URL: url, ID: id, Names: n})
	if err != nil {
		panic(err) // a struct of strings and ints always marshals
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(b))
	return cmd
}

// testReplica wires a replica as package main's newReplica does (the bench package cannot import
// main): setup, the groups table, the lanes and the elector, under one errgroup.
func testReplica(ctx context.Context, url, id string, n bench.Names, ready func()) error {
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", n.Partitions)
	if err != nil {
		return err
	}
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectBufSize(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err = setup.Ensure(sctx, js, setup.Config{Layout: lay, Incoming: n.Incoming, Outgoing: n.Outgoing, Unmapped: n.Unmapped, Groups: n.Groups, Control: n.Control})
	cancel()
	if err != nil {
		return err
	}
	groups, err := js.KeyValue(ctx, n.Groups)
	if err != nil {
		return err
	}
	control, err := js.KeyValue(ctx, n.Control)
	if err != nil {
		return err
	}
	table, err := kv.New(groups, kv.Config{})
	if err != nil {
		return err
	}
	pool, err := lanes.New(js, control, func(device string) (string, uint64, string) {
		e, ok := table.Lookup(device)
		if !ok {
			return "", 0, lanes.ReasonNoMapping
		}
		return e.Group, e.Revision, e.Reason
	}, lanes.Config{Layout: lay, Incoming: n.Incoming, NoProvenance: n.NoProvenance})
	if err != nil {
		return err
	}
	elector, err := election.New(js, control, func(ctx context.Context, l *election.Lease) error {
		return pool.Run(ctx, lanes.Assignment{Partition: l.Partition, Epoch: l.Epoch, Valid: l.Valid})
	}, election.Config{ReplicaID: id, Partitions: n.Partitions, ReleaseTimeout: pool.DrainTimeout() + 10*time.Second})
	if err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return table.Run(gctx) })
	g.Go(func() error {
		select {
		case <-table.Ready():
		case <-gctx.Done():
			return nil
		}
		if ready != nil {
			ready()
		}
		return elector.Run(gctx)
	})
	if err := g.Wait(); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}
