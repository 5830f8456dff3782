package cuda

import (
	"errors"
	"strings"
	"testing"
)

// On machines without the driver (CI) the package still builds, and says why it cannot
// run rather than crashing: a missing library, or one that is not the driver.
func TestLoadWithoutADriverSaysSo(t *testing.T) {
	if err := load("/nonexistent/libcuda.so.1"); !errors.Is(err, ErrNoDriver) {
		t.Fatalf("loading a missing driver: %v, want ErrNoDriver", err)
	}
	err := load("libc.so.6")
	if !errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "lacks cuInit") {
		t.Fatalf("loading a library that is not the driver: %v", err)
	}
}
