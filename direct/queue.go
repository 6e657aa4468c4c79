package direct

import (
	"sync"

	"github.com/nats-io/nats.go"
)

// queue holds the messages of one partition between the connection's delivery goroutine, which
// pushes, and the partition's goroutine, which takes them in batches. It never blocks the
// pusher: past its bounds a message is refused (the caller counts it). Safe for concurrent use.
type queue struct {
	mu       sync.Mutex
	items    []*nats.Msg
	bytes    int64
	maxMsgs  int
	maxBytes int64
	// ready has room for one signal, sent when items becomes non-empty; the taker drains it.
	// Nobody closes it.
	ready chan struct{}
}

func newQueue(maxMsgs int, maxBytes int64) *queue {
	return &queue{maxMsgs: maxMsgs, maxBytes: maxBytes, ready: make(chan struct{}, 1)}
}

// msgSize is what a message holds of a queue's byte bound: subject, reply, payload, and 64 bytes
// per header (an estimate: nats.go does not keep a received message's header size).
func msgSize(m *nats.Msg) int64 {
	return int64(len(m.Subject) + len(m.Reply) + len(m.Data) + 64*len(m.Header))
}

// push appends m and reports whether there was room. A message always fits an empty queue.
func (q *queue) push(m *nats.Msg) bool {
	size := msgSize(m)
	q.mu.Lock()
	if n := len(q.items); n > 0 && (n >= q.maxMsgs || q.bytes+size > q.maxBytes) {
		q.mu.Unlock()
		return false
	}
	q.items = append(q.items, m)
	q.bytes += size
	first := len(q.items) == 1
	q.mu.Unlock()
	if first {
		select {
		case q.ready <- struct{}{}:
		default:
		}
	}
	return true
}

// take returns everything queued, in order, and gives the queue spare (emptied) to fill next,
// so that two slices alternate without allocating.
func (q *queue) take(spare []*nats.Msg) []*nats.Msg {
	q.mu.Lock()
	items := q.items
	q.items, q.bytes = spare[:0], 0
	q.mu.Unlock()
	return items
}

// len returns how many messages wait.
func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items)
}
