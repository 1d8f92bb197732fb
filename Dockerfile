# kube-userspace-proxy image: a Go builder stage, then a small Debian image with iptables, iproute2,
# conntrack (to delete stale UDP flows; optional) and the binaries (kube-userspace-proxy, kup-echo; the "demo" stage adds kup-demo).
#
#   docker build -t kube-userspace-proxy .
#   docker build --target kup-echo -t kup-echo .     (kup-echo alone, static)
#
# Build arguments:
#   GO_IMAGE    the builder's base (default golang:1.26-bookworm)
#   BASE_IMAGE  the final image's base (default debian:bookworm-slim); iptables, iproute2 and
#               conntrack are installed unless the base already has iptables and iproute2
#   PREBUILT    a directory of the build context holding binaries built beforehand
#               (CGO_ENABLED=0 go build): the builder then only copies them, so GO_IMAGE need
#               not have Go (demo/run.sh uses this on machines without a registry)
#   VERSION, COMMIT   stamped into the binary (--version)
ARG GO_IMAGE=golang:1.26-bookworm
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${GO_IMAGE} AS build
ARG PREBUILT=
WORKDIR /src
ENV CGO_ENABLED=0
COPY go.mod go.sum ./
RUN if [ -z "$PREBUILT" ]; then go mod download; fi
COPY . .
ARG VERSION=dev
ARG COMMIT=unknown
RUN set -e; mkdir -p /out; \
    if [ -n "$PREBUILT" ]; then \
      cp "$PREBUILT/kube-userspace-proxy" "$PREBUILT/kup-echo" "$PREBUILT/kup-demo" /out/; \
    else \
      pkg=github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app; \
      go build -trimpath -ldflags "-s -w -X $pkg.Version=$VERSION -X $pkg.Commit=$COMMIT -X runtime.godebugDefault=memprofilerate=0" -o /out/kube-userspace-proxy ./cmd/kube-userspace-proxy; \
      go build -trimpath -ldflags "-s -w" -o /out/kup-echo ./cmd/kup-echo; \
      go build -trimpath -ldflags "-s -w" -o /out/kup-demo ./demo/kup-demo; \
    fi

# kup-echo alone, static, as its entrypoint: the local cluster's workload image
# (docker build --target kup-echo -t kup-echo:dev .; pods run it with args [serve, ...]).
FROM scratch AS kup-echo
COPY --from=build /out/kup-echo /kup-echo
ENTRYPOINT ["/kup-echo"]

FROM ${BASE_IMAGE} AS runtime
RUN if ! command -v iptables >/dev/null || ! command -v ip >/dev/null; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iptables iproute2 conntrack ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /out/kube-userspace-proxy /out/kup-echo /usr/local/bin/

# The demo's client (demo/kup-demo): applies the demo's objects and sends traffic.
FROM runtime AS demo
COPY --from=build /out/kup-demo /usr/local/bin/
CMD ["kup-demo", "--help"]

# The default target: the proxy.
FROM runtime AS kube-userspace-proxy
CMD ["kube-userspace-proxy", "--help"]
