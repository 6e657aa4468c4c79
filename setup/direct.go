package setup

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// markMode records cfg.Mode in the control bucket's [wire.ModeKey], which status and verify
// read (in direct mode there is no INCOMING to read): direct mode writes [wire.ModeDirect]
// unless the key holds it already; stream mode deletes a direct mark an earlier deployment left,
// and otherwise writes nothing (no key means stream mode, as for a bucket set up before the key
// existed). It returns line, with what it changed added.
func markMode(ctx context.Context, js jetstream.JetStream, cfg Config, line string) (string, error) {
	ctl, err := js.KeyValue(ctx, cfg.Control)
	if err != nil {
		return "", fmt.Errorf("setup: opening bucket %s: %w", cfg.Control, err)
	}
	e, err := get(ctx, ctl, wire.ModeKey)
	marked := err == nil && wire.MarksDirect(e.Value())
	if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", fmt.Errorf("setup: reading %s in bucket %s: %w", wire.ModeKey, cfg.Control, err)
	}
	switch {
	case cfg.Mode == wire.ModeDirect && !marked:
		if _, err := ctl.PutString(ctx, wire.ModeKey, string(wire.ModeDirect)); err != nil {
			return "", fmt.Errorf("setup: writing %s in bucket %s: %w", wire.ModeKey, cfg.Control, err)
		}
		return fmt.Sprintf("%s; marked as direct mode (key %s)", line, wire.ModeKey), nil
	case cfg.Mode != wire.ModeDirect && marked:
		if err := ctl.Delete(ctx, wire.ModeKey); err != nil {
			return "", fmt.Errorf("setup: deleting %s in bucket %s: %w", wire.ModeKey, cfg.Control, err)
		}
		return fmt.Sprintf("%s; its direct mode mark removed (key %s): stream mode", line, wire.ModeKey), nil
	}
	return line, nil
}

// storedWildcard is the shape of a device subject once the account mapping has written its
// partition into it: "incoming.*.*.*".
func storedWildcard(lay *subjects.Layout) string {
	prefix := lay.In.Prefix()
	return prefix + ".*." + strings.TrimPrefix(lay.StreamSubject(), prefix+".")
}

// ensureDirect checks what direct mode needs of the server: no stream capturing the device
// subjects, and the account mapping present (wire.ReceiveMapping) or absent (wire.ReceiveAll).
func ensureDirect(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	if err := CheckDirect(ctx, js, cfg); err != nil {
		return "", err
	}
	lay := cfg.Layout
	if cfg.Receive == wire.ReceiveAll {
		return fmt.Sprintf("direct mode: no stream captures %s, and the server does not map it: every replica receives every device subject and keeps its partitions (probed)",
			lay.StreamSubject()), nil
	}
	return fmt.Sprintf("direct mode: no stream captures %s; the account mapping %s → %s delivers every partition (probed)",
		lay.StreamSubject(), lay.MappingSource(), lay.MappingDest()), nil
}

// CheckDirect checks that the server delivers what devices publish as direct mode with
// cfg.Receive needs. It fails wrapping [ErrMismatch] when a stream captures the device subjects
// (the device would get that stream's acknowledgement, and the message would be stored twice),
// wrapping [ErrNoMapping] with the configuration to add when cfg.Receive is [wire.ReceiveMapping]
// and the server does not stamp the partitions, and wrapping [ErrMismatch] when cfg.Receive is
// [wire.ReceiveAll] and it does. It lists the streams (one request per shape of device subject),
// then publishes one probe per partition, on a device of that partition, with no reply subject
// and the [wire.HeaderProbe], and sees where each one arrives on core subscriptions of its own:
// nothing is stored, and the replicas drop the probes. It blocks for one round trip and at most
// five seconds.
func CheckDirect(ctx context.Context, js jetstream.JetStream, cfg Config) error {
	cfg.Defaults()
	if cfg.Layout == nil {
		return fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	if err := checkNoCapture(ctx, js, cfg); err != nil {
		return err
	}
	lay := cfg.Layout
	got, err := probeDirect(ctx, js.Conn(), lay)
	if err != nil {
		return err
	}
	var mapped, plain, wrong, lost []string
	for p, g := range got {
		switch {
		case g.arrived == "":
			lost = append(lost, g.sent)
		case g.partition < 0:
			plain = append(plain, g.sent)
		case g.partition == p:
			mapped = append(mapped, g.sent)
		default:
			wrong = append(wrong, fmt.Sprintf("%s arrived as %s, not in partition %d", g.sent, g.arrived, p))
		}
	}
	if len(lost) > 0 {
		return fmt.Errorf("setup: %d of %d probes published to %s (e.g. %s) did not come back: direct mode needs to publish to and subscribe to the device subjects and their mapped form %s",
			len(lost), len(got), lay.StreamSubject(), lost[0], storedWildcard(lay))
	}
	if cfg.Receive == wire.ReceiveAll {
		if len(plain) == len(got) {
			return nil
		}
		return fmt.Errorf("%w: the server maps what devices publish to %s into partitions (%d of %d probes arrived mapped), so a replica subscribed to %s receives nothing: run with --direct-receive %s, or remove the account mapping",
			ErrMismatch, lay.StreamSubject(), len(got)-len(plain), len(got), lay.StreamSubject(), wire.ReceiveMapping)
	}
	if len(mapped) == len(got) {
		return nil
	}
	var why string
	switch {
	case len(plain) == len(got):
		why = fmt.Sprintf("the probes published to %s (e.g. %s) arrived unchanged: the account has no mapping %s → %s",
			lay.StreamSubject(), plain[0], lay.MappingSource(), lay.MappingDest())
	case len(wrong) > 0:
		why = fmt.Sprintf("%d of %d probes arrived in the wrong partition (e.g. %s): the account maps %s with another partition count or template",
			len(wrong), len(got), wrong[0], lay.MappingSource())
	default:
		why = fmt.Sprintf("%d of %d probes arrived unchanged (e.g. %s): the account maps %s with another partition count or template",
			len(plain), len(got), plain[0], lay.MappingSource())
	}
	return fmt.Errorf("%w: %s.\n\n%s\nOr run with --direct-receive %s: every replica then receives every device subject and keeps its partitions, with no mapping",
		ErrNoMapping, why, MappingConfig(lay), wire.ReceiveAll)
}

// checkNoCapture refuses any stream whose subjects overlap what devices publish, mapped or not.
func checkNoCapture(ctx context.Context, js jetstream.JetStream, cfg Config) error {
	lay := cfg.Layout
	seen := map[string]bool{}
	var capturing []string
	for _, subject := range []string{lay.StreamSubject(), storedWildcard(lay)} {
		names := js.StreamNames(ctx, jetstream.WithStreamListSubject(subject))
		for n := range names.Name() {
			if !seen[n] {
				seen[n] = true
				capturing = append(capturing, n)
			}
		}
		if err := names.Err(); err != nil {
			return fmt.Errorf("setup: listing the streams that capture %s: %w", subject, err)
		}
	}
	if len(capturing) == 0 {
		return nil
	}
	return fmt.Errorf("%w: stream %s captures what devices publish (%s): in direct mode its acknowledgement would reach the device instead of OUTGOING's, and every message would be stored twice. Map what it holds first (run in stream mode until `kvmapper verify` passes), then remove it (`nats stream rm %s`); or run without --mode direct",
		ErrMismatch, strings.Join(capturing, ", "), lay.StreamSubject(), capturing[0])
}

// probeResult is where one probe arrived.
type probeResult struct {
	sent      string // the subject it was published to
	arrived   string // the subject it arrived on; "" if it did not
	partition int    // the partition token it arrived with; -1 when unmapped
}

// probeWaitDirect bounds the wait for the probes of [CheckDirect].
const probeWaitDirect = 5 * time.Second

// probeDirect publishes one probe per partition and returns where each arrived, by partition.
func probeDirect(ctx context.Context, nc *nats.Conn, lay *subjects.Layout) ([]probeResult, error) {
	devices := probeDevices(lay.Partitions)
	nonce := strconv.FormatInt(time.Now().UnixNano(), 36)
	arrivals := make(chan *nats.Msg, 4*lay.Partitions)
	out := make([]probeResult, len(devices))
	prefixDot := lay.In.Prefix() + "."
	var subs []*nats.Subscription
	defer func() {
		for _, s := range subs {
			_ = s.Unsubscribe()
		}
	}()
	bySubject := map[string]int{}
	for p, dev := range devices {
		subject, err := probeSubject(lay, dev)
		if err != nil {
			return nil, err
		}
		out[p] = probeResult{sent: subject, partition: -1}
		bySubject[subject] = p
		mappedForm := prefixDot + "*." + strings.TrimPrefix(subject, prefixDot)
		for _, s := range []string{subject, mappedForm} {
			sub, err := nc.ChanSubscribe(s, arrivals)
			if err != nil {
				return nil, fmt.Errorf("setup: subscribing to %s to probe direct mode: %w", s, err)
			}
			subs = append(subs, sub)
		}
	}
	for _, r := range out {
		m := nats.NewMsg(r.sent)
		m.Header.Set(wire.HeaderProbe, nonce)
		if err := nc.PublishMsg(m); err != nil {
			return nil, fmt.Errorf("setup: publishing a probe to %s: %w", r.sent, err)
		}
	}
	fctx, cancel := context.WithTimeout(ctx, probeWaitDirect)
	defer cancel()
	if err := nc.FlushWithContext(fctx); err != nil {
		return nil, fmt.Errorf("setup: probing direct mode: %w", err)
	}
	timer := time.NewTimer(probeWaitDirect)
	defer timer.Stop()
	for left := len(out); left > 0; {
		select {
		case m := <-arrivals:
			if m.Header.Get(wire.HeaderProbe) != nonce {
				continue
			}
			p, part := probeOrigin(m.Subject, prefixDot, bySubject)
			if p < 0 || out[p].arrived != "" {
				continue
			}
			out[p].arrived, out[p].partition = m.Subject, part
			left--
		case <-timer.C:
			return out, nil
		case <-ctx.Done():
			return nil, fmt.Errorf("setup: probing direct mode: %w", ctx.Err())
		}
	}
	return out, nil
}

// probeOrigin returns which probe arrived on subject, and the partition token it carries (-1
// when it arrived unmapped); -1, -1 for a subject that is not one of them.
func probeOrigin(subject, prefixDot string, bySubject map[string]int) (p, partition int) {
	if p, ok := bySubject[subject]; ok {
		return p, -1
	}
	rest := strings.TrimPrefix(subject, prefixDot)
	tok, plain, ok := strings.Cut(rest, ".")
	if !ok {
		return -1, -1
	}
	p, ok = bySubject[prefixDot+plain]
	n, err := strconv.Atoi(tok)
	if !ok || err != nil {
		return -1, -1
	}
	return p, n
}
