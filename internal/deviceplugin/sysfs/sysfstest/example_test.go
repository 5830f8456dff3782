package sysfstest_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
)

// TestWriteFixtures writes every fixture under $SYSFS_FIXTURES when set, for trying
// `device-plugin discover --sysfs-root` by hand; otherwise it checks they all write.
func TestWriteFixtures(t *testing.T) {
	base := os.Getenv("SYSFS_FIXTURES")
	if base == "" {
		base = t.TempDir()
	}
	for name, f := range sysfstest.All() {
		dir := filepath.Join(base, name)
		if err := f.Write(dir, filepath.Join(dir, "dev")); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(dir, "sys", "bus", "pci", "devices")); err != nil {
			t.Fatal(err)
		}
	}
}
