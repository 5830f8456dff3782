package realnode

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// Tag is the tag of the images the tier builds and runs.
const Tag = "dev"

// BuildImages builds images (hack/images, by name) into dir and returns their archives.
func BuildImages(dir string, names ...string) ([]string, error) {
	cmd := exec.Command("go", append([]string{"run", "./hack/images", "-version", Tag, "-out", dir}, names...)...)
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
