// Package vllmconnector carries kvhandoff's vLLM connector (the Python package beside this
// file) into engine pods: the connector image's /install copies it into the emptyDir
// that the engine container has on its PYTHONPATH, so stock vLLM images run it unchanged.
package vllmconnector

import (
	"embed"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// Package is the connector's Python package, kvhandoff_vllm.
//
//go:embed kvhandoff_vllm/*.py kvhandoff_vllm/_api/*.py
var Package embed.FS

// Install writes the package into dir (dir/kvhandoff_vllm/...), read-only.
func Install(dir string) error {
	return fs.WalkDir(Package, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		target := filepath.Join(dir, path)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		data, err := Package.ReadFile(path)
		if err != nil {
			return err
		}
		if err := os.WriteFile(target, data, 0o444); err != nil {
			return fmt.Errorf("installing the connector: %w", err)
		}
		return nil
	})
}
