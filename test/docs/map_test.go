// Package docs checks that the docs keep up with the code.
package docs

import (
	"os"
	"os/exec"
	"path"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

const module = "github.com/kvhandoff/kvhandoff"

// The README's "Where things live" names every package of the module: by its path, or
// by its name in the row of a folder above it. A package added without a row fails here.
func TestTheReadmesMapNamesEveryPackage(t *testing.T) {
	root := envtest.RepoRoot()
	b, err := os.ReadFile(root + "/README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	start := strings.Index(readme, "## Where things live")
	if start < 0 {
		t.Fatal("README.md has no \"Where things live\" section")
	}
	section := readme[start:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	rows := map[string]string{} // a folder named in a row's first cell: the row
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 {
			continue
		}
		// A cell names folders by path; a name without one is a sibling of the path
		// before it ("`internal/transferagent/agent/`, `engineapi/`").
		parent := ""
		for i, f := range strings.Split(cells[1], "`") {
			if f = strings.TrimSpace(strings.TrimSuffix(f, "/")); i%2 == 0 || f == "" {
				continue
			}
			if !strings.Contains(f, "/") && parent != "" {
				f = parent + "/" + f
			}
			rows[f] = line
			parent = path.Dir(f)
		}
	}
	cmd := exec.Command("go", "list", "./...")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		rel := strings.TrimPrefix(strings.TrimPrefix(pkg, module), "/")
		if !covered(rel, rows) {
			t.Errorf("%s: no row of the README's map names it (a row for it, or its name in the row of a folder above it)", rel)
		}
	}
}

// covered: rel has a row, or an ancestor's row names the rest of its path.
func covered(rel string, rows map[string]string) bool {
	if _, ok := rows[rel]; ok {
		return true
	}
	for dir := path.Dir(rel); dir != "." && dir != "/"; dir = path.Dir(dir) {
		row, ok := rows[dir]
		if !ok {
			continue
		}
		rest := strings.TrimPrefix(rel, dir+"/")
		if strings.Contains(row, "`"+rel+"`") || strings.Contains(row, "`"+rest+"`") || strings.Contains(row, "`"+rest+"/`") || strings.Contains(row, "`"+path.Base(rest)+"`") {
			return true
		}
	}
	return false
}
