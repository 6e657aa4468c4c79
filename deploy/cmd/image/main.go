// Command image builds kvmapper's container image from a checkout with no container daemon and
// no registry, as one tar file that docker load and podman load accept:
//
//	go -C deploy run ./cmd/image                  # writes dist/kvmapper-<version>.tar
//	docker load -i dist/kvmapper-<version>.tar
//
// It compiles a static kvmapper (CGO_ENABLED=0) with its version and commit stamped in for each
// architecture (linux/amd64 and linux/arm64 unless -arch says otherwise: Go cross-compiles), puts
// each on an empty base with the machine's CA certificates and the non-root user kvmapper
// (65532), and gathers them in an OCI image index. With one -arch, the tar holds that image alone
// (dist/kvmapper-<version>-linux-<arch>.tar).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
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
	var archList string
	flag.StringVar(&out, "o", "", "the image tar to write (default: <root>/dist/kvmapper-<tag>.tar, or …-linux-<arch>.tar for one -arch)")
	flag.StringVar(&archList, "arch", strings.Join(image.Platforms, ","), "GOARCH of the binaries and images, comma-separated: one builds an image, several an image index")
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
	archs := strings.Split(archList, ",")
	if archList == "" || slices.Contains(archs, "") {
		return fmt.Errorf("-arch %q: want GOARCH values separated by commas, e.g. amd64,arm64", archList)
	}
	if out == "" {
		name := fmt.Sprintf("kvmapper-%s.tar", tag)
		if len(archs) == 1 {
			name = fmt.Sprintf("kvmapper-%s-linux-%s.tar", tag, archs[0])
		}
		out = filepath.Join(root, "dist", name)
	}

	tmp, err := os.MkdirTemp("", "kvmapper-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	imgs, err := image.BuildAll(ctx, opts, archs, tmp)
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
	digest, err := image.WriteAll(f, opts, imgs, name, tag)
	if err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(out+".part", out); err != nil {
		return err
	}
	what := "image"
	if len(imgs) > 1 {
		what = "image index"
	}
	fmt.Printf("wrote %s: %s:%s (%s %s, linux/%s, kvmapper %s, commit %s)\n", out, name, tag, what, digest, strings.Join(archs, ", linux/"), opts.Version, opts.Commit)
	fmt.Printf("load it with: docker load -i %s   (or podman load -i …); pin it by that digest (the chart's image.digest) once pushed\n", out)
	return nil
}

func cmp(given, found string) string {
	if given != "" {
		return given
	}
	return found
}
