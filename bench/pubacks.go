package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// ackPublisher publishes as js.PublishAsync does, with a reply subject of its own per message,
// and times each acknowledgement on arrival. With a window it keeps at most that many
// unacknowledged. Not safe for concurrent use, except for its handler.
type ackPublisher struct {
	nc     *nats.Conn
	prefix string
	slots  chan struct{} // the window; nil for none
	sent   int

	mu      sync.Mutex
	pending map[int]sentAt
	lat     []time.Duration
	done    chan struct{} // signalled when pending empties
	errs    atomic.Int64
}

type sentAt struct {
	at       time.Time
	measured bool
}

func newAckPublisher(url string, window int) (*ackPublisher, error) {
	nc, err := nats.Connect(url, nats.Name("kvmapper bench publisher"))
	if err != nil {
		return nil, err
	}
	p := &ackPublisher{nc: nc, prefix: nc.NewInbox() + ".", pending: map[int]sentAt{}, done: make(chan struct{}, 1)}
	if window > 0 {
		p.slots = make(chan struct{}, window)
	}
	sub, err := nc.Subscribe(p.prefix+"*", p.ack)
	if err == nil {
		err = sub.SetPendingLimits(-1, -1)
	}
	if err != nil {
		nc.Close()
		return nil, err
	}
	return p, nil
}

func (p *ackPublisher) close() { p.nc.Close() }

// publish sends one message of size bytes (a timestamp first, then whether it is measured) to
// subject, waiting for room in the window.
func (p *ackPublisher) publish(subject string, size int, measured bool) error {
	if p.slots != nil {
		p.slots <- struct{}{}
	}
	i := p.sent
	p.sent++
	now := time.Now()
	data := make([]byte, size)
	binary.LittleEndian.PutUint64(data, uint64(now.UnixNano()))
	if measured {
		data[8] = 1
	}
	p.mu.Lock()
	p.pending[i] = sentAt{at: now, measured: measured}
	p.mu.Unlock()
	return p.nc.PublishMsg(&nats.Msg{Subject: subject, Reply: p.prefix + strconv.Itoa(i), Data: data})
}

// ack is the handler of the acknowledgements.
func (p *ackPublisher) ack(m *nats.Msg) {
	now := time.Now()
	i, err := strconv.Atoi(m.Subject[len(p.prefix):])
	if err != nil {
		return
	}
	bad := len(m.Data) == 0 || bytes.Contains(m.Data, []byte(`"error"`))
	p.mu.Lock()
	s, ok := p.pending[i]
	delete(p.pending, i)
	if ok && s.measured && !bad {
		p.lat = append(p.lat, now.Sub(s.at))
	}
	empty := len(p.pending) == 0
	p.mu.Unlock()
	if !ok {
		return
	}
	if bad {
		p.errs.Add(1)
	}
	if p.slots != nil {
		<-p.slots
	}
	if empty {
		select {
		case p.done <- struct{}{}:
		default:
		}
	}
}

// wait waits until every publish has its answer; what has none after timeout counts as errors.
func (p *ackPublisher) wait(ctx context.Context, timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		p.mu.Lock()
		n := len(p.pending)
		p.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-p.done:
		case <-t.C:
			p.errs.Add(int64(n))
			return fmt.Errorf("%d publishes not acknowledged within %v", n, timeout)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (p *ackPublisher) latencies() []time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lat
}
