package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFlagsThatCannotServeAreRefusedByName(t *testing.T) {
	short := filepath.Join(t.TempDir(), "short-token")
	_ = os.WriteFile(short, []byte("0123456789abcdef\n"), 0o600)
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--served-model is required"},
		{[]string{"--served-model", "m", "--max-blocks", "0"}, "--max-blocks is 0: must be positive"},
		{[]string{"--served-model", "m"}, "--token-file is required"},
		{[]string{"--served-model", "m", "--token-file", short}, "is 16 characters: at least 32"},
		{[]string{"--served-model", "m", "--token-file", filepath.Join(t.TempDir(), "absent")}, "--token-file: "},
		{[]string{"--mode", "kv-events"}, "flag provided but not defined: -mode"},
	} {
		var stderr bytes.Buffer
		if code := Run(c.args, &stderr, nil); code == 0 || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%v: exit %d, %s; want an error containing %q", c.args, code, stderr.String(), c.want)
		}
	}
}
