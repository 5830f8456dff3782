package cli

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
)

func discover(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := Discover(args, &out, &errOut)
	return out.String(), errOut.String(), code
}

func TestDiscoverWorksOnEveryFixture(t *testing.T) {
	for name, f := range sysfstest.All() {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if err := f.Write(dir, filepath.Join(dir, "dev")); err != nil {
				t.Fatal(err)
			}
			base := []string{"--sysfs-root", dir, "--dev-root", filepath.Join(dir, "dev"), "--nvml=false"}
			table, stderr, code := discover(t, base...)
			if code != 0 || !strings.Contains(table, "KIND") || !strings.Contains(table, "NVML: disabled") {
				t.Fatalf("table (exit %d, %s):\n%s", code, stderr, table)
			}
			js, _, code := discover(t, append(base, "-o", "json")...)
			var inv inventory.Inventory
			if code != 0 || json.Unmarshal([]byte(js), &inv) != nil || len(inv.Devices) == 0 {
				t.Fatalf("json (exit %d):\n%s", code, js)
			}
			for _, d := range inv.Devices {
				if d.Kind == "" || d.ID == "" || d.PCIBusID == "" || len(d.DeviceNodes) == 0 {
					t.Errorf("device lacks a field: %+v", d)
				}
			}
			if (name == "broken") != (len(inv.Problems) > 0) {
				t.Errorf("problems %q", inv.Problems)
			}
			pref, stderr, code := discover(t, append(base, "--prefer", "vpc.amazonaws.com/efa", "--size", "2")...)
			if code != 0 || len(strings.Split(strings.TrimSpace(pref), ",")) != 2 {
				t.Fatalf("--prefer (exit %d, %s): %q", code, stderr, pref)
			}
		})
	}
}

func TestDiscoverRefusesAnImpossiblePreference(t *testing.T) {
	dir := t.TempDir()
	if err := sysfstest.Trn2().Write(dir, filepath.Join(dir, "dev")); err != nil {
		t.Fatal(err)
	}
	_, stderr, code := discover(t, "--sysfs-root", dir, "--dev-root", filepath.Join(dir, "dev"), "--nvml=false", "--prefer",
		"vpc.amazonaws.com/efa", "--size", "17")
	if code == 0 || !strings.Contains(stderr, "cannot pick 17 of the 16 available") {
		t.Fatalf("exit %d, %s", code, stderr)
	}
	_, stderr, code = discover(t, "--sysfs-root", dir, "--nvml=false", "-o", "yaml")
	if code != 2 || !strings.Contains(stderr, `-o "yaml": want table or json`) {
		t.Fatalf("exit %d, %s", code, stderr)
	}
}
