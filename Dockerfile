# Images: `docker build --target manager .` (default) and `--target device-plugin .`.
# The transfer agent, which links libfabric, gets its own target when its code lands.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY cmd/ cmd/
COPY compat/ compat/
COPY controllers/ controllers/
COPY deviceplugin/ deviceplugin/
COPY instancetype/ instancetype/
COPY render/ render/
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/manager ./cmd/manager
# go-nvml needs cgo; it loads libnvidia-ml.so.1 from the host's driver at run time.
RUN CGO_ENABLED=1 CGO_CFLAGS=-Wno-deprecated-declarations go build -trimpath -ldflags "-s -w" -o /out/device-plugin ./cmd/device-plugin

FROM gcr.io/distroless/base-debian12 AS device-plugin
COPY --from=build /out/device-plugin /device-plugin
ENTRYPOINT ["/device-plugin"]

FROM gcr.io/distroless/static-debian12:nonroot AS manager
COPY --from=build /out/manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
