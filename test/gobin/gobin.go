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
func Build(dir, name string) (string, error) {
	bin := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-o", bin, "github.com/kvhandoff/kvhandoff/cmd/"+name)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("building %s: %w", name, err)
	}
	return bin, nil
}
