package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// What each distroless base holds, made from Debian's archive: the packages (with their
// dependencies, extracted, as distroless assembles them), and the files its maintainer
// scripts would have written: users and the CA bundle.
var distroless = map[Base][]string{
	Static: {"base-files", "netbase", "tzdata"},
	Glibc:  {"base-files", "netbase", "tzdata", "libc6", "libssl3"},
}

// baseTar returns a tarball of base's root filesystem with packages, built once with
// mmdebstrap and cached under dir.
func baseTar(dir string, base Base, packages []string) (string, error) {
	variant, include := "minbase", packages
	if pkgs, ok := distroless[base]; ok {
		variant, include = "extract", pkgs
	}
	key := sha256.Sum256([]byte(string(base) + "\n" + strings.Join(include, ",")))
	out := filepath.Join(dir, fmt.Sprintf("%s-%x.tar", baseName(base), key[:6]))
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	if _, err := exec.LookPath("mmdebstrap"); err != nil {
		return "", fmt.Errorf("mmdebstrap is not installed (apt-get install mmdebstrap): it builds the images' Debian bases")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	args := []string{"--variant=" + variant, "--quiet", "--mode=unshare", "--format=tar"}
	if len(include) > 0 {
		args = append(args, "--include="+strings.Join(include, ","))
	}
	if variant == "minbase" {
		// As debian:*-slim: no documentation, man pages or locales.
		args = append(args, "--dpkgopt=path-exclude=/usr/share/{doc,man,locale,info}/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright")
	}
	tmp := out + ".tmp"
	start := time.Now()
	cmd := exec.Command("mmdebstrap", append(args, "bookworm", tmp)...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("mmdebstrap %s: %w", base, err)
	}
	fmt.Fprintf(os.Stderr, "built the %s base in %s\n", base, time.Since(start).Round(time.Second))
	return out, os.Rename(tmp, out)
}

func baseName(b Base) string {
	switch b {
	case Static:
		return "static"
	case Glibc:
		return "glibc"
	}
	return "debian-slim"
}

// distrolessFiles is what distroless adds over its packages: the root, nobody and
// nonroot users, /tmp, nonroot's home, and the CA bundle (taken from this machine's
// ca-certificates: extracting the package does not run the script that assembles it).
func distrolessFiles() ([]byte, error) {
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	add := func(h *tar.Header, body []byte) error {
		h.Size = int64(len(body))
		h.ModTime = time.Unix(0, 0)
		if err := w.WriteHeader(h); err != nil {
			return err
		}
		_, err := w.Write(body)
		return err
	}
	files := []struct {
		name string
		mode int64
		body string
	}{
		{"etc/passwd", 0o644, "root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"},
		{"etc/group", 0o644, "root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n"},
	}
	for _, d := range []struct {
		name string
		mode int64
		uid  int
	}{{"tmp/", 0o1777, 0}, {"home/nonroot/", 0o700, 65532}, {"root/", 0o700, 0}, {"etc/ssl/certs/", 0o755, 0}} {
		if err := add(&tar.Header{Name: d.name, Typeflag: tar.TypeDir, Mode: d.mode, Uid: d.uid, Gid: d.uid}, nil); err != nil {
			return nil, err
		}
	}
	for _, f := range files {
		if err := add(&tar.Header{Name: f.name, Typeflag: tar.TypeReg, Mode: f.mode}, []byte(f.body)); err != nil {
			return nil, err
		}
	}
	certs, err := os.ReadFile("/etc/ssl/certs/ca-certificates.crt")
	if err != nil {
		return nil, fmt.Errorf("the CA bundle for the distroless bases (apt-get install ca-certificates): %w", err)
	}
	if err := add(&tar.Header{Name: "etc/ssl/certs/ca-certificates.crt", Typeflag: tar.TypeReg, Mode: 0o644}, certs); err != nil {
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// filesTar is a tarball of executables, by their paths.
func filesTar(files map[string][]byte) []byte {
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	for _, path := range slices.Sorted(maps.Keys(files)) {
		_ = w.WriteHeader(&tar.Header{Name: path[1:], Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(files[path])), ModTime: time.Unix(0, 0)})
		_, _ = w.Write(files[path])
	}
	_ = w.Close()
	return buf.Bytes()
}
