package election_test

import (
	"flag"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

func TestMain(m *testing.M) {
	flag.Parse()
	natstest.SetParallel(natstest.WaitingTests)
	goleak.VerifyTestMain(m)
}
