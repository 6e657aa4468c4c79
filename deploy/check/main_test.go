package check

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/kvmapper/kvmapper/deploy/image"
)

// built is the image TestMain built from this checkout, as `go -C deploy run ./cmd/image` builds
// it (an index of image.Platforms), and this machine's binary taken out of its layer.
var built struct {
	opts   image.Options
	tar    string  // the image tarball
	digest v1.Hash // the index's
	bin    string  // /kvmapper, extracted from the tarball's layer
	deploy string  // the deploy module's directory
	repo   string  // the kvmapper checkout
}

const (
	imageName = "kvmapper"
	imageTag  = "check"
)

func TestMain(m *testing.M) {
	dir, cleanup, err := buildImage()
	if err != nil {
		fmt.Fprintf(os.Stderr, "check: building the image: %v\n", err)
		os.Exit(1)
	}
	code := m.Run()
	cleanup()
	_ = dir
	os.Exit(code)
}

// buildImage builds the image of this checkout as `go -C deploy run ./cmd/image` does, into a
// temporary directory, and extracts this machine's binary (the image manifest.json names).
func buildImage() (string, func(), error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", nil, err
	}
	built.deploy = filepath.Dir(wd)
	built.repo = filepath.Dir(built.deploy)
	tmp, err := os.MkdirTemp("", "kvmapper-check-")
	if err != nil {
		return "", nil, err
	}
	cleanup := func() { os.RemoveAll(tmp) }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	opts := image.Options{Root: built.repo}
	if opts.Version, opts.Commit, opts.Created, err = image.Describe(ctx, built.repo); err != nil {
		cleanup()
		return "", nil, err
	}
	if opts.CAFile, err = image.DefaultCA(); err != nil {
		cleanup()
		return "", nil, err
	}
	built.opts = opts
	imgs, err := image.BuildAll(ctx, opts, image.Platforms, filepath.Join(tmp, "build"))
	if err != nil {
		cleanup()
		return "", nil, err
	}
	built.tar = filepath.Join(tmp, "kvmapper.tar")
	f, err := os.Create(built.tar)
	if err != nil {
		cleanup()
		return "", nil, err
	}
	if built.digest, err = image.WriteAll(f, opts, imgs, imageName, imageTag); err != nil {
		f.Close()
		cleanup()
		return "", nil, err
	}
	if err := f.Close(); err != nil {
		cleanup()
		return "", nil, err
	}
	built.bin = filepath.Join(tmp, "from-image", "kvmapper")
	if err := extractFromTarball(built.tar, strings.TrimPrefix(image.Binary, "/"), built.bin); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("taking %s out of the image: %w", image.Binary, err)
	}
	return tmp, cleanup, nil
}

// extractFromTarball writes the file name of the image's layers (the docker manifest.json's
// view of the tarball) to out, executable.
func extractFromTarball(tarball, name, out string) error {
	files, err := tarEntries(tarball)
	if err != nil {
		return err
	}
	var manifest []struct{ Layers []string }
	if err := json.Unmarshal(files["manifest.json"], &manifest); err != nil || len(manifest) != 1 {
		return fmt.Errorf("manifest.json: %v (%d images)", err, len(manifest))
	}
	for _, l := range manifest[0].Layers {
		entries, err := layerEntries(files[l])
		if err != nil {
			return fmt.Errorf("layer %s: %w", l, err)
		}
		if e, ok := entries[name]; ok {
			if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
				return err
			}
			return os.WriteFile(out, e.data, 0o755)
		}
	}
	return fmt.Errorf("no layer holds %s", name)
}

// tarEntries returns the regular files of a tar by name.
func tarEntries(path string) (map[string][]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if h.Typeflag == tar.TypeReg {
			if out[h.Name], err = io.ReadAll(tr); err != nil {
				return nil, err
			}
		}
	}
}

type layerEntry struct {
	hdr  *tar.Header
	data []byte
}

// layerEntries returns the entries of a gzipped layer by name, directories with a trailing /.
func layerEntries(gz []byte) (map[string]layerEntry, error) {
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	if err != nil {
		return nil, err
	}
	out := map[string]layerEntry{}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return nil, err
		}
		out[h.Name] = layerEntry{hdr: h, data: b}
	}
}

// help is what `kvmapper <command> --help` says the command accepts.
type help struct {
	flags    map[string]bool   // flag names and aliases, without dashes
	env      map[string]string // environment variable → flag
	defaults map[string]string // flag → its default, as --help prints it
	flagEnv  map[string][]string
}

var (
	// helpLine is one option of urfave/cli's help: its names (with aliases, and the repetition a
	// slice flag shows: --header value [ --header value ]), then its usage.
	helpLine = regexp.MustCompile(`^\s+(-{1,2}[a-z][\w-]*(?: [A-Za-z]+)?(?: \[ -{1,2}[a-z][\w-]* [A-Za-z]+ \])?(?:, -{1,2}[a-z][\w-]*(?: [A-Za-z]+)?)*)\s{2,}(.*)$`)
	// helpOption is any line of the help that starts like an option: each must be a helpLine, so
	// that no kind of flag goes unseen.
	helpOption = regexp.MustCompile(`^\s+-{1,2}[a-z]`)
	helpName   = regexp.MustCompile(`-{1,2}([a-z][\w-]*)`)
	helpEnv    = regexp.MustCompile(`\[(\$[A-Z_][A-Z0-9_]*(?:, \$[A-Z_][A-Z0-9_]*)*)\]\s*$`)
	helpDef    = regexp.MustCompile(`\(default: ([^)]*)\)`)
	helpMu     sync.Mutex
	helps      = map[string]*help{}
)

// helpOf runs `kvmapper <command> --help` (command "" for the top level) and parses its
// options: the names, the environment variables each reads, the defaults.
func helpOf(t *testing.T, command string) *help {
	t.Helper()
	helpMu.Lock()
	defer helpMu.Unlock()
	if h := helps[command]; h != nil {
		return h
	}
	args := []string{"--help"}
	if command != "" {
		args = []string{command, "--help"}
	}
	out, err := exec.Command(built.bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("kvmapper %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	h := &help{flags: map[string]bool{}, env: map[string]string{}, defaults: map[string]string{}, flagEnv: map[string][]string{}}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		m := helpLine.FindStringSubmatch(sc.Text())
		if m == nil {
			if helpOption.MatchString(sc.Text()) {
				t.Fatalf("kvmapper %s: the option line %q is not understood by helpLine: a flag the checks would not see", strings.Join(args, " "), sc.Text())
			}
			continue
		}
		var names []string
		for _, n := range helpName.FindAllStringSubmatch(m[1], -1) {
			if !slices.Contains(names, n[1]) {
				names = append(names, n[1])
			}
			h.flags[n[1]] = true
		}
		if e := helpEnv.FindStringSubmatch(m[2]); e != nil {
			for v := range strings.SplitSeq(e[1], ", ") {
				h.env[strings.TrimPrefix(v, "$")] = names[0]
				h.flagEnv[names[0]] = append(h.flagEnv[names[0]], strings.TrimPrefix(v, "$"))
			}
		}
		if d := helpDef.FindAllStringSubmatch(m[2], -1); d != nil {
			h.defaults[names[0]] = strings.Trim(d[len(d)-1][1], `"`)
		}
	}
	if len(h.flags) < 5 || len(h.env) < 5 {
		t.Fatalf("kvmapper %s: found %d flags and %d environment variables in its output; has the help's shape changed?\n%s", strings.Join(args, " "), len(h.flags), len(h.env), out)
	}
	helps[command] = h
	return h
}

// process is a kvmapper process a test started; its output is kept for the log.
type process struct {
	t    *testing.T
	name string
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// start starts the image's binary with args and exactly env (plus PATH), killed at cleanup.
func start(t *testing.T, name string, args []string, env []string) *process {
	t.Helper()
	return startCommand(t, name, built.bin, args, env)
}

// startCommand starts the program path as start starts the image's binary.
func startCommand(t *testing.T, name, path string, args []string, env []string) *process {
	t.Helper()
	p := &process{t: t, name: name, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(path, args...)
	p.cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}, env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s (%s) output:\n%s", name, strings.Join(args, " "), p.out.String())
		}
	})
	return p
}

// wait waits for the process to exit within timeout and returns its exit code.
func (p *process) wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.t.Fatalf("%s did not exit within %v", p.name, timeout)
	}
	if p.err == nil {
		return 0
	}
	if ee, ok := p.err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	p.t.Fatalf("%s: %v", p.name, p.err)
	return -1
}

// stop sends SIGTERM and returns the exit code, failing after timeout.
func (p *process) stop(timeout time.Duration) int {
	p.t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	return p.wait(timeout)
}

// logValue waits until the process logs a JSON line whose message contains msg and returns
// that line's field (a number as it is written).
func (p *process) logValue(msg, field string, timeout time.Duration) string {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		for l := range strings.SplitSeq(p.out.String(), "\n") {
			var m map[string]any
			if json.Unmarshal([]byte(l), &m) != nil {
				continue
			}
			if s, _ := m["message"].(string); strings.Contains(s, msg) {
				switch v := m[field].(type) {
				case string:
					return v
				case float64:
					return strconv.FormatFloat(v, 'f', -1, 64)
				}
			}
		}
		select {
		case <-p.done:
			p.t.Fatalf("%s exited (%v) before logging %q", p.name, p.err, msg)
		default:
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s logged no %q with %s within %v", p.name, msg, field, timeout)
		}
		time.Sleep(20 * time.Millisecond) // polling the output to a deadline
	}
}

// eventually polls f until it returns nil or timeout passes.
func eventually(t *testing.T, timeout time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %v", timeout, err)
		}
		time.Sleep(50 * time.Millisecond) // polling to a deadline
	}
}

// get returns the status and body of GET url.
func get(url string) (int, string, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// freePort returns a loopback port nobody listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
