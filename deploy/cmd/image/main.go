// Command image builds kvmapper's container image from a checkout with no container daemon and
// no registry, as one tar file that docker load and podman load accept:
//
//	go -C deploy run ./cmd/image                  # writes dist/kvmapper-<version>-linux-<arch>.tar
//	docker load -i dist/kvmapper-<version>-linux-amd64.tar
//
// It compiles a static kvmapper (CGO_ENABLED=0) with its version and commit stamped in, and puts
// it on an empty base with the machine's CA certificates and the non-root user kvmapper (65532).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"time"

	"github.com/kvmapper/kvmapper/deploy/image"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	var opts image.Options
	var out, name, tag, created string
	flag.StringVar(&opts.Root, "root", "..", "the kvmapper checkout (its go.mod's directory); the default is right for go -C deploy run")
	flag.StringVar(&out, "o", "", "the image tar to write (default: <root>/dist/kvmapper-<tag>-linux-<arch>.tar)")
	flag.StringVar(&opts.Arch, "arch", "", "GOARCH of the binary and the image (default: this machine's)")
	flag.StringVar(&opts.Version, "version", "", "version to stamp and tag (default: git describe --tags --always --dirty)")
	flag.StringVar(&opts.Commit, "commit", "", "commit to stamp (default: git rev-parse HEAD)")
	flag.StringVar(&created, "created", "", "creation time, RFC 3339 (default: the commit's time, so that a commit always builds the same image)")
	flag.StringVar(&opts.CAFile, "ca-certificates", "", "PEM bundle of CA certificates to include (default: this machine's)")
	flag.StringVar(&name, "name", "kvmapper", "image name the tar loads as")
	flag.StringVar(&tag, "tag", "", "image tag (default: the version)")
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (see -h)", flag.Args())
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	root, err := filepath.Abs(opts.Root)
	if err != nil {
		return err
	}
	opts.Root = root
	if opts.Version == "" || opts.Commit == "" || created == "" {
		v, c, t, err := image.Describe(ctx, root)
		if err != nil {
			return err
		}
		opts.Version, opts.Commit, opts.Created = cmp(opts.Version, v), cmp(opts.Commit, c), t
	}
	if created != "" {
		if opts.Created, err = time.Parse(time.RFC3339, created); err != nil {
			return fmt.Errorf("-created %q: %w", created, err)
		}
	}
	if opts.CAFile == "" {
		if opts.CAFile, err = image.DefaultCA(); err != nil {
			return err
		}
	}
	if tag == "" {
		tag = image.Tag(opts.Version)
	}
	arch := opts.Arch
	if arch == "" {
		arch = runtime.GOARCH
	}
	if out == "" {
		out = filepath.Join(root, "dist", fmt.Sprintf("kvmapper-%s-linux-%s.tar", tag, arch))
	}

	tmp, err := os.MkdirTemp("", "kvmapper-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	bin := filepath.Join(tmp, "kvmapper")
	if err := image.BuildBinary(ctx, opts, bin); err != nil {
		return err
	}
	img, err := image.Build(opts, bin)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	f, err := os.Create(out + ".part")
	if err != nil {
		return err
	}
	if err := image.Write(f, img, name, tag); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(out+".part", out); err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("wrote %s: %s:%s (%s, linux/%s, kvmapper %s, commit %s)\n", out, name, tag, digest, arch, opts.Version, opts.Commit)
	fmt.Printf("load it with: docker load -i %s   (or podman load -i …)\n", out)
	return nil
}

func cmp(given, found string) string {
	if given != "" {
		return given
	}
	return found
}
