# kvmapper's image for those who build with a container engine and a registry. Without either,
# `go -C deploy run ./cmd/image` builds the same image, for linux/amd64 and linux/arm64, as a
# tarball (docs/deploy.md); CI checks that the two agree (deploy/check
# TestDockerfileBuildsTheSameImage).
#
#   docker buildx build --platform linux/amd64,linux/arm64 -t kvmapper:$(git describe --tags --always --dirty) \
#     --build-arg VERSION=$(git describe --tags --always --dirty) --build-arg COMMIT=$(git rev-parse HEAD) \
#     --build-arg CREATED=$(git log -1 --format=%cI) .

# The build stage runs on the build machine's platform and cross-compiles for the target's, so
# that `docker buildx build --platform linux/amd64,linux/arm64` builds both without emulation.
# Its tag is go.mod's Go version, so that the build downloads no other toolchain. It is not
# pinned by digest yet: this file was last changed without access to a registry, so no digest
# could be read, and none is made up. Pin it as golang:<version>@sha256:<the index's digest>
# (`crane digest golang:1.26.8`, or `docker buildx imagetools inspect golang:1.26.8`);
# deploy/check TestDockerfileBuildsTheSameImage checks the form and the version either way.
FROM --platform=$BUILDPLATFORM golang:1.26.8 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG COMMIT=unknown
ARG TARGETARCH
# Static (no C library on an empty base), stamped with the version and commit.
RUN CGO_ENABLED=0 GOOS=linux GOARCH=${TARGETARCH} \
    go build -trimpath -ldflags "-s -w -X main.version=${VERSION} -X main.commit=${COMMIT}" -o /out/kvmapper .

FROM scratch
ARG VERSION=dev
ARG COMMIT=unknown
ARG CREATED=1970-01-01T00:00:00Z
# The CA certificates (TLS to NATS servers with public certificates), the user kvmapper.
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY deploy/image/rootfs/ /
COPY --from=build /out/kvmapper /kvmapper
USER 65532:65532
LABEL org.opencontainers.image.title="kvmapper" \
      org.opencontainers.image.description="Republishes NATS JetStream messages onto subjects looked up in a NATS KV bucket, in per-device order, with failover across replicas" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="https://github.com/kvmapper/kvmapper" \
      org.opencontainers.image.url="https://github.com/kvmapper/kvmapper" \
      org.opencontainers.image.documentation="https://github.com/kvmapper/kvmapper/blob/main/docs/deploy.md"
ENTRYPOINT ["/kvmapper"]
CMD ["run"]
