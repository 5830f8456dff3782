# Images: `docker build --target manager .` (default), `--target device-plugin .`,
# `--target transfer-agent .`, `--target router .` and `--target vllm-connector .`. Build
# the manager with --build-arg VERSION=<tag> so that it renders the router and the vLLM
# connector of its own version. `make images` builds the same images without Docker;
# hack/images/images.go describes them, and its test holds this file to that table.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY cmd/ cmd/
COPY internal/ internal/
COPY transferagent/ transferagent/
COPY vllm-connector/ vllm-connector/
ARG VERSION=latest
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X github.com/kvhandoff/kvhandoff/internal/render.DefaultRouterImage=ghcr.io/kvhandoff/router:${VERSION} -X github.com/kvhandoff/kvhandoff/internal/render.DefaultConnectorImage=ghcr.io/kvhandoff/vllm-connector:${VERSION}" -o /out/manager ./cmd/manager
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/router ./cmd/router
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/endpoint-picker ./cmd/endpoint-picker
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/kv-events ./cmd/kv-events
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/install ./cmd/connector-install
# go-nvml needs cgo; it loads libnvidia-ml.so.1 from the host's driver at run time.
RUN CGO_ENABLED=1 CGO_CFLAGS=-Wno-deprecated-declarations go build -trimpath -ldflags "-s -w" -o /out/device-plugin ./cmd/device-plugin

# The transfer agent links libfabric dynamically: built against Debian's headers, it runs
# on the node's own libfabric (the AWS EFA installer's, mounted at /opt/amazon/efa and
# first on LD_LIBRARY_PATH in config/agent), with Debian's as the fallback for tcp/shm.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libfabric-dev >/dev/null
RUN CGO_ENABLED=1 CGO_CFLAGS=-Wno-deprecated-declarations go build -trimpath -ldflags "-s -w" -o /out/transfer-agent ./cmd/transfer-agent

FROM debian:bookworm-slim AS transfer-agent
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libfabric1 >/dev/null && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/transfer-agent /transfer-agent
ENTRYPOINT ["/transfer-agent"]

FROM gcr.io/distroless/base-debian12 AS device-plugin
COPY --from=build /out/device-plugin /device-plugin
ENTRYPOINT ["/device-plugin"]

# The request path's programs: the router (and a decode pod's leg runner), the gateway's
# endpoint picker and an engine's kv-events sidecar.
FROM gcr.io/distroless/static-debian12:nonroot AS router
COPY --from=build /out/router /router
COPY --from=build /out/endpoint-picker /endpoint-picker
COPY --from=build /out/kv-events /kv-events
USER 65532:65532
ENTRYPOINT ["/router"]

# The init container of executor-Agent engines: /install DIR copies the connector's Python
# package (embedded in the binary) into DIR, an emptyDir on the engine's PYTHONPATH.
FROM gcr.io/distroless/static-debian12:nonroot AS vllm-connector
COPY --from=build /out/install /install
USER 65532:65532
ENTRYPOINT ["/install"]

FROM gcr.io/distroless/static-debian12:nonroot AS manager
COPY --from=build /out/manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
