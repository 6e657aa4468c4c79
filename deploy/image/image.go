// Package image builds kvmapper's container image with no container daemon and no registry: a
// static kvmapper binary (CGO_ENABLED=0) on an empty base, with CA certificates and a non-root
// user, labelled with OCI annotations, for each of [Platforms] (Go cross-compiles), gathered in
// an OCI image index and written as one tar file that holds an OCI image layout and a docker
// manifest.json beside it (the build machine's architecture), so that both docker load and
// podman load take it.
//
// The Dockerfile at the repository's root builds the same image with a registry: the same
// binary flags, the same files (rootfs/ here), the same entrypoint, user and labels.
package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/x509"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// What the image runs, and as whom. The Dockerfile says the same.
const (
	// Binary is where the kvmapper binary is in the image.
	Binary = "/kvmapper"
	// User is the numeric user and group the image runs as: kvmapper in rootfs/etc/passwd.
	User = "65532:65532"
	// CACertificates is where the CA bundle is in the image: the first path Go's crypto/x509
	// reads on Linux.
	CACertificates = "/etc/ssl/certs/ca-certificates.crt"
	// Source is the repository the image is built from, for its labels.
	Source = "https://github.com/kvmapper/kvmapper"
)

// Cmd is the image's default command after [Binary]: one replica (`docker run IMAGE --help`
// replaces it).
var Cmd = []string{"run"}

// Platforms are the architectures the image is built for unless told otherwise, each a linux
// manifest of the image index, in its order.
var Platforms = []string{"amd64", "arm64"}

// variant is the OCI platform variant of arch: arm64 is v8, as the official images say.
func variant(arch string) string {
	if arch == "arm64" {
		return "v8"
	}
	return ""
}

// rootfs holds the files the image adds besides the binary and the CA bundle.
//
//go:embed rootfs
var rootfs embed.FS

// Options say what to build. Zero fields take the defaults [Describe] and [DefaultCA] give.
type Options struct {
	// Root is the kvmapper checkout: the directory of its go.mod.
	Root string
	// Version and Commit are stamped into the binary (main.version, main.commit) and label
	// the image.
	Version, Commit string
	// Created is the image's creation time and every file's modification time: the commit's
	// time, so that one commit always builds the same image.
	Created time.Time
	// Arch is the GOARCH of the binary and the image; default runtime.GOARCH.
	Arch string
	// CAFile is the PEM bundle of CA certificates to put at [CACertificates].
	CAFile string
}

// Describe returns the version, commit and commit time of the checkout at root, from git: the
// version is `git describe --tags --always --dirty`.
func Describe(ctx context.Context, root string) (version, commit string, created time.Time, err error) {
	git := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, "git", args...)
		cmd.Dir = root
		out, err := cmd.Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				err = fmt.Errorf("%w: %s", err, bytes.TrimSpace(ee.Stderr))
			}
			return "", fmt.Errorf("git %s in %s: %w (give --version, --commit and --created to build from a tree that is not a git checkout)", strings.Join(args, " "), root, err)
		}
		return strings.TrimSpace(string(out)), nil
	}
	if version, err = git("describe", "--tags", "--always", "--dirty"); err != nil {
		return "", "", time.Time{}, err
	}
	if commit, err = git("rev-parse", "HEAD"); err != nil {
		return "", "", time.Time{}, err
	}
	ts, err := git("log", "-1", "--format=%ct")
	if err != nil {
		return "", "", time.Time{}, err
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return "", "", time.Time{}, fmt.Errorf("git log -1 --format=%%ct in %s: %q is not a time", root, ts)
	}
	return version, commit, time.Unix(sec, 0).UTC(), nil
}

// DefaultCA returns the first CA bundle found where Linux distributions keep one.
func DefaultCA() (string, error) {
	for _, p := range []string{
		"/etc/ssl/certs/ca-certificates.crt", // Debian, Ubuntu, Alpine, Arch
		"/etc/pki/tls/certs/ca-bundle.crt",   // Fedora, RHEL
		"/etc/ssl/ca-bundle.pem",             // openSUSE
		"/etc/ssl/cert.pem",                  // macOS, BSDs
	} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("no CA certificate bundle found on this machine (install ca-certificates, or give one with --ca-certificates FILE)")
}

// Tag returns version as an image tag: what a tag may not hold becomes '-'.
func Tag(version string) string {
	t := regexp.MustCompile(`[^A-Za-z0-9_.-]`).ReplaceAllString(version, "-")
	if t == "" || t[0] == '.' || t[0] == '-' {
		t = "v" + t
	}
	if len(t) > 128 {
		t = t[:128]
	}
	return t
}

// LDFlags are the linker flags that stamp version and commit into the binary.
func LDFlags(version, commit string) string {
	return fmt.Sprintf("-s -w -X main.version=%s -X main.commit=%s", version, commit)
}

// BuildBinary compiles the kvmapper of opts.Root into out: static (CGO_ENABLED=0), for Linux on
// opts.Arch, with version and commit stamped in.
func BuildBinary(ctx context.Context, opts Options, out string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", LDFlags(opts.Version, opts.Commit), "-o", out, ".")
	cmd.Dir = opts.Root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+opts.arch())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build in %s: %w\n%s", opts.Root, err, stderr.Bytes())
	}
	return nil
}

func (o Options) arch() string {
	if o.Arch == "" {
		return runtime.GOARCH
	}
	return o.Arch
}

// Labels are the OCI annotations of the image: in its config's labels (what docker inspect
// shows) and on its manifest.
func (o Options) Labels() map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":         "kvmapper",
		"org.opencontainers.image.description":   "Republishes NATS JetStream messages onto subjects looked up in a NATS KV bucket, in per-device order, with failover across replicas",
		"org.opencontainers.image.version":       o.Version,
		"org.opencontainers.image.revision":      o.Commit,
		"org.opencontainers.image.created":       o.Created.UTC().Format(time.RFC3339),
		"org.opencontainers.image.source":        Source,
		"org.opencontainers.image.url":           Source,
		"org.opencontainers.image.documentation": Source + "/blob/main/docs/deploy.md",
	}
}

// Build returns the image of the binary at bin: one layer with the binary at [Binary], the CA
// bundle of opts.CAFile at [CACertificates] and rootfs/ (the user), on an empty base.
func Build(opts Options, bin string) (v1.Image, error) {
	if opts.Version == "" || opts.Commit == "" || opts.Created.IsZero() {
		return nil, errors.New("image: Version, Commit and Created are required")
	}
	binary, err := os.ReadFile(bin)
	if err != nil {
		return nil, fmt.Errorf("image: reading the binary: %w", err)
	}
	ca, err := os.ReadFile(opts.CAFile)
	if err != nil {
		return nil, fmt.Errorf("image: reading the CA bundle: %w", err)
	}
	if pool := x509.NewCertPool(); !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("image: %s holds no PEM certificate", opts.CAFile)
	}
	files := map[string]file{
		strings.TrimPrefix(Binary, "/"):         {data: binary, mode: 0o755},
		strings.TrimPrefix(CACertificates, "/"): {data: ca, mode: 0o644},
	}
	err = fs.WalkDir(rootfs, "rootfs", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := rootfs.ReadFile(p)
		files[strings.TrimPrefix(p, "rootfs/")] = file{data: b, mode: 0o644}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("image: reading rootfs: %w", err)
	}
	layerTar, err := tarFiles(files, opts.Created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("image: layer: %w", err)
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{Layer: layer, History: v1.History{
		Created:   v1.Time{Time: opts.Created},
		CreatedBy: "go -C deploy run ./cmd/image (kvmapper " + opts.Version + ")",
		Comment:   "kvmapper, CA certificates, user kvmapper",
	}})
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS, cf.Variant = opts.arch(), "linux", variant(opts.arch())
	cf.Created = v1.Time{Time: opts.Created}
	cf.Config = v1.Config{
		Entrypoint: []string{Binary},
		Cmd:        Cmd,
		User:       User,
		WorkingDir: "/",
		Labels:     opts.Labels(),
	}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	return mutate.Annotations(img, opts.Labels()).(v1.Image), nil
}

// BuildAll compiles the kvmapper of opts.Root for each of archs (opts.Arch aside) into dir and
// returns the image of each, in archs' order.
func BuildAll(ctx context.Context, opts Options, archs []string, dir string) ([]v1.Image, error) {
	if len(archs) == 0 {
		return nil, errors.New("image: no architecture to build for")
	}
	var imgs []v1.Image
	for _, arch := range archs {
		o := opts
		o.Arch = arch
		bin := filepath.Join(dir, arch, "kvmapper")
		if err := BuildBinary(ctx, o, bin); err != nil {
			return nil, err
		}
		img, err := Build(o, bin)
		if err != nil {
			return nil, err
		}
		imgs = append(imgs, img)
	}
	return imgs, nil
}

// Index returns the OCI image index of imgs, one manifest each, its descriptor naming the
// image's platform (as its config says), annotated with opts' labels as the images are.
func Index(opts Options, imgs []v1.Image) (v1.ImageIndex, error) {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	seen := map[string]bool{}
	for _, img := range imgs {
		cf, err := img.ConfigFile()
		if err != nil {
			return nil, fmt.Errorf("image: %w", err)
		}
		p := v1.Platform{OS: cf.OS, Architecture: cf.Architecture, Variant: cf.Variant}
		if seen[p.String()] {
			return nil, fmt.Errorf("image: two images for %s", p.String())
		}
		seen[p.String()] = true
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			MediaType: types.OCIManifestSchema1, Platform: &p,
		}})
	}
	return mutate.Annotations(idx, opts.Labels()).(v1.ImageIndex), nil
}

type file struct {
	data []byte
	mode int64
}

// tarFiles returns a tar of files (paths relative to /) and their parent directories, in order,
// owned by root, all modified at mtime.
func tarFiles(files map[string]file, mtime time.Time) ([]byte, error) {
	dirs := map[string]bool{}
	for p := range files {
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var names []string
	for d := range dirs {
		names = append(names, d+"/")
	}
	for p := range files {
		names = append(names, p)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		h := &tar.Header{Name: n, ModTime: mtime, Uname: "root", Gname: "root", Format: tar.FormatPAX}
		if strings.HasSuffix(n, "/") {
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		} else {
			f := files[n]
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, f.mode, int64(len(f.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("image: layer tar: %w", err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write(files[n].data); err != nil {
				return nil, fmt.Errorf("image: layer tar: %w", err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("image: layer tar: %w", err)
	}
	return buf.Bytes(), nil
}

// FullName returns an image name with its registry, as containerd names images: kvmapper is
// docker.io/library/kvmapper.
func FullName(name string) string {
	first, _, found := strings.Cut(name, "/")
	if found && (strings.ContainsAny(first, ".:") || first == "localhost") {
		return name
	}
	if !found {
		name = "library/" + name
	}
	return "docker.io/" + name
}

// layoutTar writes the files of an OCI image layout, and a docker archive's manifest.json beside
// it, into one tar; each blob once.
type layoutTar struct {
	tw    *tar.Writer
	mtime time.Time
	blobs map[v1.Hash]bool
}

func (l *layoutTar) add(name string, data []byte) error {
	if err := l.tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: l.mtime, Typeflag: tar.TypeReg}); err != nil {
		return err
	}
	_, err := l.tw.Write(data)
	return err
}

func blobPath(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }

func (l *layoutTar) blob(h v1.Hash, data []byte) error {
	if l.blobs[h] {
		return nil
	}
	l.blobs[h] = true
	return l.add(blobPath(h), data)
}

// image writes img's config, layers and manifest as blobs and returns its manifest's descriptor
// and the docker archive's entry for it.
func (l *layoutTar) image(img v1.Image) (v1.Descriptor, tarball.Descriptor, error) {
	var entry tarball.Descriptor
	cfgName, err := img.ConfigName()
	if err != nil {
		return v1.Descriptor{}, entry, err
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		return v1.Descriptor{}, entry, err
	}
	if err := l.blob(cfgName, cfg); err != nil {
		return v1.Descriptor{}, entry, err
	}
	entry.Config = blobPath(cfgName)
	layers, err := img.Layers()
	if err != nil {
		return v1.Descriptor{}, entry, err
	}
	for _, layer := range layers {
		d, err := layer.Digest()
		if err != nil {
			return v1.Descriptor{}, entry, err
		}
		rc, err := layer.Compressed()
		if err != nil {
			return v1.Descriptor{}, entry, err
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			return v1.Descriptor{}, entry, err
		}
		if err := l.blob(d, b); err != nil {
			return v1.Descriptor{}, entry, err
		}
		entry.Layers = append(entry.Layers, blobPath(d))
	}
	raw, err := img.RawManifest()
	if err != nil {
		return v1.Descriptor{}, entry, err
	}
	digest, err := img.Digest()
	if err != nil {
		return v1.Descriptor{}, entry, err
	}
	if err := l.blob(digest, raw); err != nil {
		return v1.Descriptor{}, entry, err
	}
	return v1.Descriptor{MediaType: types.OCIManifestSchema1, Digest: digest, Size: int64(len(raw))}, entry, nil
}

// finish writes oci-layout, index.json naming top as name:tag, and manifest.json tagging the
// docker archive's entry name:tag.
func (l *layoutTar) finish(top v1.Descriptor, entry tarball.Descriptor, name, tag string) error {
	top.Annotations = map[string]string{
		"org.opencontainers.image.ref.name": tag,
		"io.containerd.image.name":          FullName(name) + ":" + tag,
	}
	index, err := json.Marshal(v1.IndexManifest{SchemaVersion: 2, MediaType: types.OCIImageIndex, Manifests: []v1.Descriptor{top}})
	if err != nil {
		return err
	}
	if err := l.add("index.json", index); err != nil {
		return err
	}
	entry.RepoTags = []string{name + ":" + tag}
	manifest, err := json.Marshal([]tarball.Descriptor{entry})
	if err != nil {
		return err
	}
	if err := l.add("manifest.json", manifest); err != nil {
		return err
	}
	return l.tw.Close()
}

func newLayoutTar(w io.Writer, mtime time.Time) (*layoutTar, error) {
	l := &layoutTar{tw: tar.NewWriter(w), mtime: mtime, blobs: map[v1.Hash]bool{}}
	return l, l.add("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
}

// Write writes img to w as a tar of an OCI image layout (oci-layout, index.json, blobs/) whose
// index names it name:tag, plus the manifest.json of `docker save` pointing into the same
// blobs, as Docker 25 and later write it: docker load, podman load and any OCI tool read it.
func Write(w io.Writer, img v1.Image, name, tag string) error {
	var mtime time.Time
	if cf, err := img.ConfigFile(); err == nil {
		mtime = cf.Created.Time
	}
	err := func() error {
		l, err := newLayoutTar(w, mtime)
		if err != nil {
			return err
		}
		desc, entry, err := l.image(img)
		if err != nil {
			return err
		}
		return l.finish(desc, entry, name, tag)
	}()
	if err != nil {
		return fmt.Errorf("image: writing the image tar: %w", err)
	}
	return nil
}

// WriteIndex writes idx to w as Write writes an image: an OCI image layout whose index.json names
// the image index name:tag (each platform's image in its blobs), and the manifest.json of
// `docker save` for the image of architecture local alone, which a docker load without
// containerd's image store (one platform an image) takes.
func WriteIndex(w io.Writer, idx v1.ImageIndex, name, tag, local string) error {
	err := func() error {
		im, err := idx.IndexManifest()
		if err != nil {
			return err
		}
		var l *layoutTar
		var localEntry *tarball.Descriptor
		for _, d := range im.Manifests {
			img, err := idx.Image(d.Digest)
			if err != nil {
				return err
			}
			if l == nil {
				cf, err := img.ConfigFile()
				if err != nil {
					return err
				}
				if l, err = newLayoutTar(w, cf.Created.Time); err != nil {
					return err
				}
			}
			_, entry, err := l.image(img)
			if err != nil {
				return err
			}
			if d.Platform != nil && d.Platform.Architecture == local {
				localEntry = &entry
			}
		}
		if l == nil {
			return errors.New("the index has no image")
		}
		if localEntry == nil {
			return fmt.Errorf("the index has no image for %s, which docker load would take", local)
		}
		raw, err := idx.RawManifest()
		if err != nil {
			return err
		}
		digest, err := idx.Digest()
		if err != nil {
			return err
		}
		if err := l.blob(digest, raw); err != nil {
			return err
		}
		return l.finish(v1.Descriptor{MediaType: types.OCIImageIndex, Digest: digest, Size: int64(len(raw))}, *localEntry, name, tag)
	}()
	if err != nil {
		return fmt.Errorf("image: writing the image tar: %w", err)
	}
	return nil
}

// WriteAll writes what `go -C deploy run ./cmd/image` writes for imgs (from [BuildAll]): the image
// itself for one ([Write]), else their [Index] ([WriteIndex]), whose docker manifest.json names
// this machine's architecture's image (or the first one's); and returns the digest to pin, the
// image's or the index's.
func WriteAll(w io.Writer, opts Options, imgs []v1.Image, name, tag string) (v1.Hash, error) {
	if len(imgs) == 1 {
		if err := Write(w, imgs[0], name, tag); err != nil {
			return v1.Hash{}, err
		}
		return imgs[0].Digest()
	}
	idx, err := Index(opts, imgs)
	if err != nil {
		return v1.Hash{}, err
	}
	local := ""
	for _, img := range imgs {
		cf, err := img.ConfigFile()
		if err != nil {
			return v1.Hash{}, fmt.Errorf("image: %w", err)
		}
		if local == "" || cf.Architecture == runtime.GOARCH {
			local = cf.Architecture
		}
	}
	if err := WriteIndex(w, idx, name, tag, local); err != nil {
		return v1.Hash{}, err
	}
	return idx.Digest()
}
