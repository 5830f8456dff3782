package realnode

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// Registry and Tag name the images the tier builds and runs: Registry/<name>:Tag.
const (
	Registry = "ghcr.io/kvhandoff"
	Tag      = "dev"
)

// BuildImages builds images (hack/images, by name) into dir and returns their archives.
func BuildImages(dir string, names ...string) ([]string, error) {
	args := []string{"run", "./hack/images", "-version", Tag, "-out", dir}
	if slices.Contains(names, VLLMImage) {
		venv, err := VLLMVenv()
		if err != nil {
			return nil, err
		}
		args = append(args, "-vllm-venv", venv)
	}
	cmd := exec.Command("go", append(args, names...)...)
	cmd.Dir = envtest.RepoRoot()
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("building the images %v with hack/images: %w", names, err)
	}
	var archives []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if f := strings.Split(line, "\t"); len(f) >= 2 {
			archives = append(archives, f[1])
		}
	}
	if len(archives) != len(names) {
		return nil, fmt.Errorf("hack/images built %d of the images %v:\n%s", len(archives), names, out)
	}
	for i, a := range archives {
		if !filepath.IsAbs(a) {
			archives[i] = filepath.Join(envtest.RepoRoot(), a)
		}
	}
	return archives, nil
}

// VLLMImage is the real-vLLM engine image (hack/images/vllm.go): the real-vLLM tier's
// environment and its tiny model at VLLMModel.
const (
	VLLMImage = "vllm-cpu"
	VLLMModel = "/models/tiny"
)

// VLLMVenv makes (once, cached) and returns the real-vLLM tier's Python environment.
func VLLMVenv() (string, error) {
	root := envtest.RepoRoot()
	cmd := exec.Command(filepath.Join(root, "hack", "python-venv.sh"), filepath.Join(root, "vllm-connector", "requirements-test.txt"))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/python-venv.sh: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}
