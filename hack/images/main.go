// Command images builds kvhandoff's images without Docker (make images): each Go command
// is built on this machine as the Dockerfile's build stage builds it, its base is made
// from Debian's archive with mmdebstrap (cached), and the image is written as a Docker
// archive that `ctr images import` and `docker load` take. images.go is the one
// description both follow.
//
//	go run ./hack/images -version v0.3.0 -out bin/images [name...]
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func main() {
	version := flag.String("version", "dev", "the images' tag, stamped into the manager as the tag of the images it renders")
	out := flag.String("out", "bin/images", "folder for the image archives (<name>.tar)")
	cache := flag.String("cache", defaultCache(), "folder for the Debian bases")
	venv := flag.String("vllm-venv", "", "the real-vLLM tier's Python environment, which the "+VLLMCPU.Name+" image (built only when named) carries")
	bases := flag.Bool("bases", false, "only make the Debian bases the named images need (every image's when none is named) and exit: "+
		"all that building an image downloads, for callers that build them later without a network")
	flag.Parse()
	run := run
	if *bases {
		run = func(_, _, cache, _ string, names []string) error { return makeBases(cache, names) }
	}
	if err := run(*version, *out, *cache, *venv, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

// defaultCache is $KVHANDOFF_CACHE/images, or ~/.cache/kvhandoff/images.
func defaultCache() string {
	if c := os.Getenv("KVHANDOFF_CACHE"); c != "" {
		return filepath.Join(c, "images")
	}
	return filepath.Join(os.Getenv("HOME"), ".cache", "kvhandoff", "images")
}

// makeBases makes (or finds cached) the bases of the images named, every image's when
// none is named.
func makeBases(cache string, names []string) error {
	for _, img := range append(append(append([]Image{}, Images...), TestImages...), VLLMCPU) {
		if len(names) > 0 && !slices.Contains(names, img.Name) {
			continue
		}
		if _, err := baseTar(filepath.Join(cache, "bases"), img.Base, img.Packages); err != nil {
			return fmt.Errorf("%s: %w", img.Name, err)
		}
	}
	return nil
}

func run(version, out, cache, venv string, names []string) error {
	all := append(append([]Image{}, Images...), TestImages...)
	for _, n := range names {
		if n != VLLMCPU.Name && !slices.ContainsFunc(all, func(i Image) bool { return i.Name == n }) {
			return fmt.Errorf("no image %q", n)
		}
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if slices.Contains(names, VLLMCPU.Name) {
		start := time.Now()
		path, err := buildVLLM(version, cache, venv)
		if err != nil {
			return fmt.Errorf("%s: %w", VLLMCPU.Name, err)
		}
		fmt.Printf("%s\t%s\t%s\n", VLLMCPU.Ref(version), path, time.Since(start).Round(100*time.Millisecond))
	}
	for _, img := range all {
		if len(names) > 0 && !slices.Contains(names, img.Name) {
			continue
		}
		start := time.Now()
		path := filepath.Join(out, img.Name+".tar")
		if err := build(img, version, out, cache, path); err != nil {
			return fmt.Errorf("%s: %w", img.Name, err)
		}
		fmt.Printf("%s\t%s\t%s\n", img.Ref(version), path, time.Since(start).Round(100*time.Millisecond))
	}
	return nil
}

// LDFlags are the linker flags of an image's binary at version.
func (i Image) LDFlags(version string) string {
	flags := "-s -w"
	if i.StampsImages {
		for _, stamp := range []struct{ v, image string }{{"DefaultRouterImage", "router"}, {"DefaultConnectorImage", "vllm-connector"}} {
			flags += fmt.Sprintf(" -X github.com/kvhandoff/kvhandoff/internal/render.%s=%s/%s:%s", stamp.v, Registry, stamp.image, version)
		}
	}
	return flags
}

func build(img Image, version, out, cache, path string) error {
	files := map[string]string{} // path in the image: the binary's here
	if img.Prebuilt != nil {
		bin, err := img.Prebuilt()
		if err != nil {
			return err
		}
		files[img.Binary] = bin
	} else {
		for _, p := range append([]Program{{img.Package, img.Binary}}, img.Also...) {
			bin := filepath.Join(out, ".bin", img.Name+"-"+filepath.Base(p.Binary))
			cmd := exec.Command("go", "build", "-trimpath", "-ldflags", img.LDFlags(version), "-o", bin, p.Package)
			cmd.Env = append(os.Environ(), "CGO_CFLAGS=-Wno-deprecated-declarations", fmt.Sprintf("CGO_ENABLED=%d", map[bool]int{false: 0, true: 1}[img.CGO]))
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("go build %s: %w", p.Package, err)
			}
			files[p.Binary] = bin
		}
	}
	base, err := baseTar(filepath.Join(cache, "bases"), img.Base, img.Packages)
	if err != nil {
		return err
	}
	layers := []v1.Layer{}
	l, err := tarball.LayerFromFile(base)
	if err != nil {
		return err
	}
	layers = append(layers, l)
	if _, ok := distroless[img.Base]; ok {
		files, err := distrolessFiles()
		if err != nil {
			return err
		}
		if l, err = layerOf(files); err != nil {
			return err
		}
		layers = append(layers, l)
	}
	binaries := map[string][]byte{}
	for at, bin := range files {
		if binaries[at], err = os.ReadFile(bin); err != nil {
			return err
		}
	}
	if l, err = layerOf(filesTar(binaries)); err != nil {
		return err
	}
	layers = append(layers, l)

	return writeImage(path, img, version, layers)
}

// writeImage writes img at version, made of layers, as a Docker archive at path.
func writeImage(path string, img Image, version string, layers []v1.Layer) error {
	image, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		return err
	}
	cfg, err := image.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture, cfg.OS = "amd64", "linux"
	cfg.Config.Entrypoint = []string{img.Binary}
	cfg.Config.User = img.User
	cfg.Config.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	cfg.Config.Labels = map[string]string{"org.opencontainers.image.source": "https://github.com/kvhandoff/kvhandoff", "org.opencontainers.image.version": version}
	if image, err = mutate.ConfigFile(image, cfg); err != nil {
		return err
	}
	tag, err := name.NewTag(img.Ref(version))
	if err != nil {
		return err
	}
	return tarball.WriteToFile(path, tag, image)
}

func layerOf(b []byte) (v1.Layer, error) {
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
}
