package bench_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"testing"

	"github.com/rs/zerolog"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/bench"
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
	if err := bench.RunReplica(ctx, zerolog.Nop(), a.URL, a.ID, a.Names, nil); err != nil {
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
