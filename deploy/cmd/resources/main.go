// Command resources measures what one kvmapper replica uses at a given rate, for the chart's
// resource requests: a NATS server with JetStream (in this process, in the partition-streams
// layout, as the chart's default NATS gets), a kvmapper replica (a process of its own, the
// binary built from this checkout as the image builds it), and a publisher at --rate messages a
// second of --payload bytes from --devices devices (in this process). After --warmup it reads the
// replica's CPU time and memory from /proc for --duration, and its mapped count from /metrics:
//
//	go -C deploy run ./cmd/resources --rate 50000 --duration 30s
//
// The figures are the replica's alone. On a machine whose cores the server and the publisher
// share with it, the rate reached may be lower than asked: the output says so, and gives the
// CPU per message, from which the cores at the asked rate follow.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/deploy/image"
	"github.com/kvmapper/kvmapper/subjects"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "resources: %v\n", err)
		os.Exit(1)
	}
}

type options struct {
	rate, devices, payload int
	warmup, duration       time.Duration
	bin, root              string
	extra                  string
}

func run() error {
	var o options
	flag.IntVar(&o.rate, "rate", 50_000, "messages a second to publish")
	flag.IntVar(&o.devices, "devices", 10_000, "devices publishing, all mapped")
	flag.IntVar(&o.payload, "payload", 128, "message size in bytes")
	flag.DurationVar(&o.warmup, "warmup", 10*time.Second, "load before the measurement starts")
	flag.DurationVar(&o.duration, "duration", 30*time.Second, "length of the measurement")
	flag.StringVar(&o.bin, "kvmapper", "", "kvmapper binary to measure (default: build this checkout's, as the image does)")
	flag.StringVar(&o.root, "root", "..", "the kvmapper checkout")
	flag.StringVar(&o.extra, "args", "", "extra flags for kvmapper run, space-separated")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	tmp, err := os.MkdirTemp("", "kvmapper-resources-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if o.bin == "" {
		root, err := filepath.Abs(o.root)
		if err != nil {
			return err
		}
		opts := image.Options{Root: root}
		if opts.Version, opts.Commit, _, err = image.Describe(ctx, root); err != nil {
			return err
		}
		o.bin = filepath.Join(tmp, "kvmapper")
		if err := image.BuildBinary(ctx, opts, o.bin); err != nil {
			return err
		}
	}
	load0 := loadavg()

	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", 16)
	if err != nil {
		return err
	}
	gacc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
	if err := gacc.AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
		return err
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: filepath.Join(tmp, "nats"),
		NoSigs: true, NoLog: true, Accounts: []*server.Account{gacc}, JetStreamMaxStore: 20 << 30})
	if err != nil {
		return err
	}
	srv.Start()
	defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
	if !srv.ReadyForConnections(10 * time.Second) {
		return errors.New("the NATS server did not start")
	}
	url := srv.ClientURL()

	setup := exec.CommandContext(ctx, o.bin, "setup", "--server", url, "--layout", "streams", "--log-format", "json")
	if out, err := setup.CombinedOutput(); err != nil {
		return fmt.Errorf("kvmapper setup: %v\n%s", err, out)
	}
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(8192))
	if err != nil {
		return err
	}
	groups, err := js.KeyValue(ctx, "device-groups")
	if err != nil {
		return err
	}
	for d := range o.devices {
		if _, err := groups.Put(ctx, fmt.Sprintf("dev-%d", d), []byte(fmt.Sprintf("group-%d", d%8))); err != nil {
			return err
		}
	}

	args := []string{"run", "--server", url, "--metrics-listen", "127.0.0.1:0", "--log-format", "json", "--replica-id", "measured"}
	args = append(args, strings.Fields(o.extra)...)
	rep := exec.Command(o.bin, args...)
	logs, err := rep.StdoutPipe()
	if err != nil {
		return err
	}
	rep.Stderr = rep.Stdout
	if err := rep.Start(); err != nil {
		return err
	}
	defer func() { _ = rep.Process.Signal(syscall.SIGTERM); _ = rep.Wait() }()
	// The replica logs where its metrics listen at start-up; after that only its warnings and
	// errors are shown.
	addr, err := metricsAddr(logs, 30*time.Second)
	if err != nil {
		return err
	}

	// The publisher: rate messages a second, in 1 ms ticks, round robin over the devices.
	pctx, pcancel := context.WithCancel(ctx)
	defer pcancel()
	payload := make([]byte, o.payload)
	published := make(chan int64, 1)
	go func() {
		var n int64
		defer func() { published <- n }()
		start := time.Now()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-pctx.Done():
				return
			case <-tick.C:
			}
			due := int64(time.Since(start).Seconds() * float64(o.rate))
			for ; n < due; n++ {
				// A full window waits for acknowledgements: the rate then is what the server takes.
				if _, err := js.PublishAsync(fmt.Sprintf("incoming.dev-%d.temp", n%int64(o.devices)), payload, jetstream.WithStallWait(10*time.Second)); err != nil {
					fmt.Fprintf(os.Stderr, "resources: publish: %v\n", err)
					return
				}
			}
		}
	}()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(o.warmup):
	}
	cpu0, err := cpuSeconds(rep.Process.Pid)
	if err != nil {
		return err
	}
	mapped0, err := mapped(addr)
	if err != nil {
		return err
	}
	t0 := time.Now()
	var rssMax int64
	end := time.After(o.duration)
	for done := false; !done; {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-end:
			done = true
		case <-time.After(500 * time.Millisecond):
		}
		if rss, err := statusKB(rep.Process.Pid, "VmRSS"); err == nil && rss > rssMax {
			rssMax = rss
		}
	}
	cpu1, err := cpuSeconds(rep.Process.Pid)
	if err != nil {
		return err
	}
	mapped1, err := mapped(addr)
	if err != nil {
		return err
	}
	elapsed := time.Since(t0).Seconds()
	if mapped1 <= mapped0 {
		return errors.New("the replica mapped nothing during the measurement (did the publisher stop? see above)")
	}
	hwm, _ := statusKB(rep.Process.Pid, "VmHWM")
	pcancel()
	pub := <-published
	rate := (mapped1 - mapped0) / elapsed
	cores := (cpu1 - cpu0) / elapsed
	perMsg := (cpu1 - cpu0) / (mapped1 - mapped0)
	res := map[string]any{
		"asked_rate": o.rate, "published": pub, "mapped_rate": round(rate), "replica_cores": round2(cores),
		"replica_cpu_us_per_msg": round2(perMsg * 1e6), "replica_cores_at_asked_rate": round2(perMsg * float64(o.rate)),
		"replica_rss_max_mib": round(float64(rssMax) / 1024), "replica_rss_peak_mib": round(float64(hwm) / 1024),
		"devices": o.devices, "payload": o.payload, "duration_s": round(elapsed),
		"loadavg_before": load0, "loadavg_after": loadavg(), "cpus": runtime.NumCPU(),
	}
	b, _ := json.MarshalIndent(res, "", "  ")
	fmt.Println(string(b))
	if rate < 0.95*float64(o.rate) {
		fmt.Fprintf(os.Stderr, "resources: the replica mapped %.0f msgs/s, below the %d asked (the server and the publisher share this machine's cores): its cores at %d msgs/s are extrapolated from the CPU per message\n", rate, o.rate, o.rate)
	}
	return nil
}

// metricsAddr reads the replica's log until it says where its metrics listen, then drains the
// rest in the background.
func metricsAddr(r io.Reader, timeout time.Duration) (string, error) {
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(r)
		sent := false
		for sc.Scan() {
			var m map[string]any
			if !sent && json.Unmarshal(sc.Bytes(), &m) == nil {
				if a, ok := m["addr"].(string); ok && strings.Contains(fmt.Sprint(m["message"]), "metrics listening") {
					found <- a
					sent = true
				}
			}
			if strings.Contains(sc.Text(), `"level":"error"`) || strings.Contains(sc.Text(), `"level":"warn"`) {
				fmt.Fprintln(os.Stderr, "replica:", sc.Text())
			}
		}
	}()
	select {
	case a := <-found:
		return a, nil
	case <-time.After(timeout):
		return "", errors.New("the replica did not say where its metrics listen (is its log level above info?)")
	}
}

func mapped(addr string) (float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	m := regexp.MustCompile(`(?m)^kvmapper_mapped_total (\S+)$`).FindSubmatch(b)
	if m == nil {
		return 0, errors.New("no kvmapper_mapped_total in /metrics")
	}
	return strconv.ParseFloat(string(m[1]), 64)
}

// cpuSeconds is the process's user and system CPU time (/proc/<pid>/stat, fields 14 and 15).
func cpuSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ")"[0])+2:]))
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100, nil // USER_HZ is 100 on Linux
}

func statusKB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	m := regexp.MustCompile(`(?m)^` + field + `:\s+(\d+) kB`).FindSubmatch(b)
	if m == nil {
		return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
	}
	return strconv.ParseInt(string(m[1]), 10, 64)
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.Join(strings.Fields(string(b))[:3], " ")
}

func round(f float64) float64  { return float64(int64(f + 0.5)) }
func round2(f float64) float64 { return float64(int64(f*100+0.5)) / 100 }
