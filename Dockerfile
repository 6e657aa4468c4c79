# kvmapper's image for those who build with a container engine and a registry. Without either,
# `go -C deploy run ./cmd/image` builds the same image as a tarball (docs/deploy.md); CI checks
# that the two agree (deploy/check TestDockerfileBuildsTheSameImage).
#
#   docker build -t kvmapper:$(git describe --tags --always --dirty) \
#     --build-arg VERSION=$(git describe --tags --always --dirty) --build-arg COMMIT=$(git rev-parse HEAD) \
#     --build-arg CREATED=$(git log -1 --format=%cI) .

FROM golang:1.26 AS build
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
