package check

import (
	"bytes"
	"crypto/x509"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/kvmapper/kvmapper/deploy/image"
)

// The tarball is both an OCI image layout (what podman load, skopeo, crane and containerd read)
// and a docker save archive (manifest.json, what docker load reads). The layout's index.json
// names, as name:tag, an image index with one image per architecture of image.Platforms; the
// docker archive's image is this machine's of them.
func TestImageTarballIsOCILayoutAndDockerArchive(t *testing.T) {
	files, err := tarEntries(built.tar)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(files["oci-layout"]); got != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout = %q, want imageLayoutVersion 1.0.0", got)
	}
	top, err := layout.ImageIndexFromPath(unpacked(t, files))
	if err != nil {
		t.Fatalf("reading the OCI layout: %v", err)
	}
	im, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 {
		t.Fatalf("index.json lists %d manifests, want the image index alone", len(im.Manifests))
	}
	desc := im.Manifests[0]
	if got := desc.Annotations["org.opencontainers.image.ref.name"]; got != imageTag {
		t.Errorf("index.json ref.name = %q, want %q", got, imageTag)
	}
	if got, want := desc.Annotations["io.containerd.image.name"], "docker.io/library/"+imageName+":"+imageTag; got != want {
		t.Errorf("index.json io.containerd.image.name = %q, want %q", got, want)
	}
	if desc.MediaType != "application/vnd.oci.image.index.v1+json" || desc.Digest != built.digest {
		t.Fatalf("index.json names %s %s, want the image index %s the build printed", desc.MediaType, desc.Digest, built.digest)
	}
	idx, err := top.ImageIndex(desc.Digest)
	if err != nil {
		t.Fatalf("the image index: %v", err)
	}
	local, ok := platformImage(t, idx, runtime.GOARCH)
	if !ok {
		t.Fatalf("the index has no image for this machine's linux/%s", runtime.GOARCH)
	}
	docker, err := tarball.ImageFromPath(built.tar, nil)
	if err != nil {
		t.Fatalf("reading the tarball as docker load does (manifest.json): %v", err)
	}
	if m, _ := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(built.tar) }); len(m) != 1 || !slices.Equal(m[0].RepoTags, []string{imageName + ":" + imageTag}) {
		t.Errorf("manifest.json = %+v, want one image tagged %s:%s", m, imageName, imageTag)
	}
	ociCfg, _ := local.ConfigName()
	dockerCfg, _ := docker.ConfigName()
	if ociCfg != dockerCfg {
		t.Errorf("manifest.json's config %s is not the index's linux/%s image's %s", dockerCfg, runtime.GOARCH, ociCfg)
	}
	ims, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if ims.MediaType != "application/vnd.oci.image.index.v1+json" {
		t.Errorf("the image index's media type %s, want OCI's", ims.MediaType)
	}
	for k, want := range built.opts.Labels() {
		if got := ims.Annotations[k]; got != want {
			t.Errorf("index annotation %s = %q, want %q", k, got, want)
		}
	}
	for _, d := range ims.Manifests {
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		layers, err := img.Layers()
		if err != nil || len(layers) != 1 {
			t.Fatalf("%s: image layers: %d, %v; want 1", d.Platform, len(layers), err)
		}
		// Digests and diff IDs are checked against the blobs themselves.
		if _, err := layers[0].Uncompressed(); err != nil {
			t.Fatal(err)
		}
		mf, err := img.Manifest()
		if err != nil {
			t.Fatal(err)
		}
		if mf.MediaType != "application/vnd.oci.image.manifest.v1+json" || mf.Config.MediaType != "application/vnd.oci.image.config.v1+json" {
			t.Errorf("%s: manifest media types %s, config %s; want OCI", d.Platform, mf.MediaType, mf.Config.MediaType)
		}
		for k, want := range built.opts.Labels() {
			if got := mf.Annotations[k]; got != want {
				t.Errorf("%s: manifest annotation %s = %q, want %q", d.Platform, k, got, want)
			}
		}
	}
}

// unpacked writes files into a directory and returns it.
func unpacked(t *testing.T, files map[string][]byte) string {
	t.Helper()
	dir := t.TempDir()
	for name, b := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// platformImage returns the image of linux/arch in idx.
func platformImage(t *testing.T, idx v1.ImageIndex, arch string) (v1.Image, bool) {
	t.Helper()
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range im.Manifests {
		if d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == arch {
			img, err := idx.Image(d.Digest)
			if err != nil {
				t.Fatal(err)
			}
			return img, true
		}
	}
	return nil, false
}

// The image index holds one image for each of linux/amd64 and linux/arm64 (arm64 as v8), each
// descriptor's platform what its config says; each image's binary is a static ELF for that
// machine, and runs where this machine can run it: this machine's always (it says its version),
// another's when the kernel can execute it (binfmt_misc with QEMU, say), which is logged either
// way.
func TestImageIndexHoldsBothArchitectures(t *testing.T) {
	files, err := tarEntries(built.tar)
	if err != nil {
		t.Fatal(err)
	}
	top, err := layout.ImageIndexFromPath(unpacked(t, files))
	if err != nil {
		t.Fatal(err)
	}
	idx, err := top.ImageIndex(built.digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	var platforms []string
	for _, d := range im.Manifests {
		if d.Platform == nil {
			t.Fatalf("the index's manifest %s names no platform", d.Digest)
		}
		platforms = append(platforms, d.Platform.String())
	}
	if want := []string{"linux/amd64", "linux/arm64/v8"}; !slices.Equal(platforms, want) {
		t.Fatalf("the index's platforms %q, want %q", platforms, want)
	}
	machines := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	for _, d := range im.Manifests {
		arch := d.Platform.Architecture
		img, _ := platformImage(t, idx, arch)
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.OS != d.Platform.OS || cf.Architecture != arch || cf.Variant != d.Platform.Variant {
			t.Errorf("%s: the config says %s/%s/%s", d.Platform, cf.OS, cf.Architecture, cf.Variant)
		}
		bin := binaryOf(t, img)
		f, err := elf.NewFile(bytes.NewReader(bin))
		if err != nil {
			t.Fatalf("%s: the binary is not ELF: %v", d.Platform, err)
		}
		if f.Machine != machines[arch] {
			t.Errorf("%s: the binary is for %v", d.Platform, f.Machine)
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				t.Errorf("%s: the binary has an ELF interpreter: it is dynamically linked", d.Platform)
			}
		}
		p := filepath.Join(t.TempDir(), "kvmapper")
		if err := os.WriteFile(p, bin, 0o755); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(p, "--version").CombinedOutput()
		want := fmt.Sprintf("kvmapper version %s (commit %s)\n", built.opts.Version, built.opts.Commit)
		switch {
		case err == nil && string(out) == want:
			t.Logf("%s: the binary runs here: %s", d.Platform, strings.TrimSpace(string(out)))
		case arch != runtime.GOARCH && errors.Is(err, syscall.ENOEXEC):
			t.Logf("%s: this machine cannot execute it (%v); checked as ELF only", d.Platform, err)
		default:
			t.Errorf("%s: kvmapper --version = %q, %v; want %q", d.Platform, out, err, want)
		}
	}
}

// binaryOf returns the kvmapper binary of img's layer.
func binaryOf(t *testing.T, img v1.Image) []byte {
	t.Helper()
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("image layers: %d, %v; want 1", len(layers), err)
	}
	rc, err := layers[0].Compressed()
	if err != nil {
		t.Fatal(err)
	}
	gz, err := io.ReadAll(rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	entries, err := layerEntries(gz)
	if err != nil {
		t.Fatal(err)
	}
	e, ok := entries[strings.TrimPrefix(image.Binary, "/")]
	if !ok {
		t.Fatalf("no %s in the layer", image.Binary)
	}
	return e.data
}

// The config runs the binary as a user that is not root, as the image's /etc/passwd names it,
// and carries the OCI labels with this checkout's version and commit.
func TestImageConfig(t *testing.T) {
	img, err := tarball.ImageFromPath(built.tar, nil)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	c := cf.Config
	if !slices.Equal(c.Entrypoint, []string{"/kvmapper"}) || !slices.Equal(c.Cmd, []string{"run"}) {
		t.Errorf("entrypoint %q, cmd %q; want [/kvmapper] [run]", c.Entrypoint, c.Cmd)
	}
	if cf.OS != "linux" || cf.Architecture == "" {
		t.Errorf("platform %s/%s, want linux/<arch>", cf.OS, cf.Architecture)
	}
	uid, gid, ok := strings.Cut(c.User, ":")
	if !ok || uid == "0" || gid == "0" || !regexp.MustCompile(`^\d+$`).MatchString(uid) {
		t.Fatalf("user %q: want numeric uid:gid, not root (Kubernetes' runAsNonRoot needs a number)", c.User)
	}
	want := map[string]string{
		"org.opencontainers.image.title":    "kvmapper",
		"org.opencontainers.image.version":  built.opts.Version,
		"org.opencontainers.image.revision": built.opts.Commit,
		"org.opencontainers.image.created":  built.opts.Created.UTC().Format(time.RFC3339),
		"org.opencontainers.image.source":   image.Source,
	}
	for k, v := range want {
		if got := c.Labels[k]; got != v {
			t.Errorf("label %s = %q, want %q", k, got, v)
		}
	}
	if !cf.Created.Time.Equal(built.opts.Created) {
		t.Errorf("created %v, want the commit's time %v", cf.Created.Time, built.opts.Created)
	}

	layers, _ := img.Layers()
	rc, err := layers[0].Compressed()
	if err != nil {
		t.Fatal(err)
	}
	gz, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := layerEntries(gz)
	if err != nil {
		t.Fatal(err)
	}
	bin, ok := entries[strings.TrimPrefix(c.Entrypoint[0], "/")]
	if !ok || bin.hdr.Mode&0o111 == 0 {
		t.Fatalf("the entrypoint %s is not an executable file of the layer", c.Entrypoint[0])
	}
	var names []string
	for n := range entries {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		if h := entries[n].hdr; h.Uid != 0 || h.Gid != 0 || (h.Typeflag != '5' && h.Mode&0o022 != 0) {
			t.Errorf("%s: owner %d:%d mode %o; want root's, not writable by others", n, h.Uid, h.Gid, h.Mode)
		}
	}
	t.Logf("layer: %v", names)
	passwd := string(entries["etc/passwd"].data)
	if !regexp.MustCompile(`(?m)^[a-z]+:x:` + uid + `:` + gid + `:`).MatchString(passwd) {
		t.Errorf("etc/passwd has no user %s:%s:\n%s", uid, gid, passwd)
	}
	if !regexp.MustCompile(`(?m)^[a-z]+:x:` + gid + `:`).MatchString(string(entries["etc/group"].data)) {
		t.Errorf("etc/group has no group %s", gid)
	}
	// The CA bundle is where Go's crypto/x509 looks first on Linux, and it is one.
	ca, ok := entries["etc/ssl/certs/ca-certificates.crt"]
	if !ok {
		t.Fatal("no etc/ssl/certs/ca-certificates.crt in the layer")
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca.data) {
		t.Fatal("etc/ssl/certs/ca-certificates.crt holds no certificate")
	}
	if n := bytes.Count(ca.data, []byte("BEGIN CERTIFICATE")); n < 50 {
		t.Errorf("the CA bundle holds %d certificates; a system bundle has over a hundred", n)
	}

	// The binary is static: no interpreter, no shared libraries (there are none on an empty base).
	f, err := elf.NewFile(bytes.NewReader(bin.data))
	if err != nil {
		t.Fatalf("the binary is not ELF: %v", err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary has an ELF interpreter: it is dynamically linked (build it with CGO_ENABLED=0)")
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("the binary needs shared libraries %v", libs)
	}
	if m := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[cf.Architecture]; m != 0 && f.Machine != m {
		t.Errorf("binary for %v, image says %s", f.Machine, cf.Architecture)
	}
}

// The binary out of the image says its version and commit, and `run --embedded` answers
// /readyz, then stops cleanly on SIGTERM.
func TestImageBinaryRuns(t *testing.T) {
	out, err := exec.Command(built.bin, "--version").CombinedOutput()
	want := fmt.Sprintf("kvmapper version %s (commit %s)\n", built.opts.Version, built.opts.Commit)
	if err != nil || string(out) != want {
		t.Fatalf("kvmapper --version = %q, %v; want %q", out, err, want)
	}
	// -1: the embedded server listens on a port of its own; :0, the metrics too.
	p := start(t, "kvmapper run --embedded", []string{"run", "--embedded", "--listen", "127.0.0.1:-1",
		"--data-dir", t.TempDir(), "--metrics-listen", "127.0.0.1:0", "--log-format", "json"}, nil)
	addr := p.logValue("metrics listening", "addr", 30*time.Second)
	eventually(t, 30*time.Second, func() error {
		code, body, err := get("http://" + addr + "/readyz")
		if err != nil || code != 200 {
			return fmt.Errorf("GET /readyz = %d %q, %v; want 200", code, body, err)
		}
		return nil
	})
	if code := p.stop(30 * time.Second); code != 0 {
		t.Errorf("run --embedded exited %d after SIGTERM, want 0", code)
	}
}

// The Dockerfile builds the same image with a registry: the same build flags, the same files,
// entrypoint, command, user and labels as the image this package builds.
func TestDockerfileBuildsTheSameImage(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(built.repo, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	stages := regexp.MustCompile(`(?m)^FROM `).FindAllStringIndex(df, -1)
	if len(stages) < 2 {
		t.Fatalf("the Dockerfile has %d stages, want a build stage and the image", len(stages))
	}
	final := df[stages[len(stages)-1][0]:]
	if !regexp.MustCompile(`^FROM scratch\b`).MatchString(final) {
		t.Errorf("the final stage starts %q, want FROM scratch", strings.SplitN(final, "\n", 2)[0])
	}
	jsonOf := func(instr string) []string {
		m := regexp.MustCompile(`(?m)^` + instr + ` (\[.*\])\s*$`).FindStringSubmatch(final)
		if m == nil {
			t.Errorf("the final stage has no %s [...]", instr)
			return nil
		}
		var v []string
		if err := json.Unmarshal([]byte(m[1]), &v); err != nil {
			t.Errorf("%s %s: %v", instr, m[1], err)
		}
		return v
	}
	if got := jsonOf("ENTRYPOINT"); !slices.Equal(got, []string{image.Binary}) {
		t.Errorf("ENTRYPOINT %q, want [%s]", got, image.Binary)
	}
	if got := jsonOf("CMD"); !slices.Equal(got, image.Cmd) {
		t.Errorf("CMD %q, want %q", got, image.Cmd)
	}
	if m := regexp.MustCompile(`(?m)^USER (\S+)\s*$`).FindStringSubmatch(final); m == nil || m[1] != image.User {
		t.Errorf("USER %v, want %s", m, image.User)
	}
	for k := range built.opts.Labels() {
		if !strings.Contains(final, k+"=") {
			t.Errorf("the final stage does not set the label %s", k)
		}
	}
	for _, copyLine := range []string{"COPY --from=build /out/kvmapper " + image.Binary, "COPY deploy/image/rootfs/ /", "/etc/ssl/certs/ca-certificates.crt " + image.CACertificates} {
		if !strings.Contains(final, copyLine) {
			t.Errorf("the final stage lacks %q", copyLine)
		}
	}
	build := df[:stages[len(stages)-1][0]]
	ld := image.LDFlags("${VERSION}", "${COMMIT}")
	for _, s := range []string{"CGO_ENABLED=0", "-trimpath", `-ldflags "` + ld + `"`} {
		if !strings.Contains(build, s) {
			t.Errorf("the build stage lacks %q (what deploy/image builds with)", s)
		}
	}
	// The build stage cross-compiles on the build machine's platform for the target's, from
	// go.mod's exact Go version (no toolchain downloaded), pinned by an image index digest if at
	// all (see the Dockerfile: none could be read where it was written).
	goVersion := regexp.MustCompile(`(?m)^go (\S+)`).FindStringSubmatch(readFile(t, filepath.Join(built.repo, "go.mod")))
	if goVersion == nil {
		t.Fatal("go.mod has no go line")
	}
	from := regexp.MustCompile(`(?m)^FROM --platform=\$BUILDPLATFORM golang:([^\s@]+)(@sha256:[0-9a-f]{64})? AS build\s*$`).FindStringSubmatch(build)
	switch {
	case from == nil:
		t.Errorf("the build stage is not FROM --platform=$BUILDPLATFORM golang:<version>[@sha256:<digest>] AS build:\n%s", build)
	case from[1] != goVersion[1]:
		t.Errorf("FROM golang:%s, but go.mod says go %s: the build would download another toolchain", from[1], goVersion[1])
	case from[2] == "":
		t.Logf("FROM golang:%s is not pinned by digest (no registry where it was written): pin it as the Dockerfile says", from[1])
	}
	if !strings.Contains(build, "GOARCH=${TARGETARCH}") || !regexp.MustCompile(`(?m)^ARG TARGETARCH\s*$`).MatchString(build) {
		t.Error("the build stage does not compile for ${TARGETARCH} (ARG TARGETARCH, GOARCH=${TARGETARCH})")
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// One architecture (cmd/image -arch amd64) writes that image alone, as before the index: the
// layout's index.json names its manifest as name:tag, and manifest.json the same image.
func TestImageOneArchitectureIsOneImage(t *testing.T) {
	top, err := layout.ImageIndexFromPath(unpacked(t, mustEntries(t, built.tar)))
	if err != nil {
		t.Fatal(err)
	}
	idx, err := top.ImageIndex(built.digest)
	if err != nil {
		t.Fatal(err)
	}
	img, _ := platformImage(t, idx, runtime.GOARCH)
	p := filepath.Join(t.TempDir(), "one.tar")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	digest, err := image.WriteAll(f, built.opts, []v1.Image{img}, imageName, imageTag)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	want, _ := img.Digest()
	one, err := layout.ImageIndexFromPath(unpacked(t, mustEntries(t, p)))
	if err != nil {
		t.Fatal(err)
	}
	im, err := one.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if digest != want || len(im.Manifests) != 1 || im.Manifests[0].Digest != want || im.Manifests[0].MediaType != "application/vnd.oci.image.manifest.v1+json" ||
		im.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != imageTag {
		t.Errorf("one architecture: digest %s, index.json %+v; want the image %s alone, named %s", digest, im.Manifests, want, imageTag)
	}
	docker, err := tarball.ImageFromPath(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	// A docker archive holds no manifest of its own: its image is known by its config.
	if got, want := configName(t, docker), configName(t, img); got != want {
		t.Errorf("manifest.json's image has config %s, want %s", got, want)
	}
}

func mustEntries(t *testing.T, tarball string) map[string][]byte {
	t.Helper()
	files, err := tarEntries(tarball)
	if err != nil {
		t.Fatal(err)
	}
	return files
}

func configName(t *testing.T, img v1.Image) v1.Hash {
	t.Helper()
	h, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	return h
}
