package vllmconnector

import (
	"os"
	"path/filepath"
	"testing"
)

// The init container must deliver every module of the package as it is in the tree: a
// file left out (the generated gRPC code lives in _api, which embed skips by default)
// would fail the engine's import at start.
func TestInstallWritesEveryModuleOfThePackage(t *testing.T) {
	dir := t.TempDir()
	if err := Install(dir); err != nil {
		t.Fatal(err)
	}
	want, err := filepath.Glob("kvhandoff_vllm/*.py")
	if err != nil {
		t.Fatal(err)
	}
	api, _ := filepath.Glob("kvhandoff_vllm/_api/*.py")
	want = append(want, api...)
	if len(want) < 8 {
		t.Fatalf("only %d modules found in the tree", len(want))
	}
	for _, path := range want {
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(dir, path))
		if err != nil {
			t.Fatalf("%s was not installed: %v", path, err)
		}
		if string(got) != string(src) {
			t.Errorf("%s differs from the tree", path)
		}
	}
}
