# The manager image. The transfer agent and device plugin, which link libfabric and
# NVML, get their own images when their code lands.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY cmd/ cmd/
COPY compat/ compat/
COPY controllers/ controllers/
COPY instancetype/ instancetype/
COPY render/ render/
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/manager ./cmd/manager

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
