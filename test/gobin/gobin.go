// Package gobin builds this module's commands for tests and benchmarks that run them as
// processes, as they run in production.
package gobin

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// Build builds cmd/<name> of this module into dir and returns the binary's path.
func Build(dir, name string) (string, error) { return BuildPackage(dir, "cmd/"+name) }

// BuildPackage builds the main package at path pkg of this module (cmd/<name>,
// test/<name>) into dir and returns the binary's path.
func BuildPackage(dir, pkg string) (string, error) {
	name := filepath.Base(pkg)
	bin := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-o", bin, "github.com/kvhandoff/kvhandoff/"+pkg)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("building %s: %w", name, err)
	}
	return bin, nil
}
