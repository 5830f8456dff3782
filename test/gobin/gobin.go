// Package gobin builds this module's commands for tests and benchmarks that run them as
// processes, as they run in production, starts them and reads their metrics.
package gobin

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
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

// Start runs bin with args until the test ends and returns the submatches of the first
// line of its log (stderr) that matches serving, the line where it says where it serves.
// The test fails if the program exits, or has not said so within a minute.
func Start(t testing.TB, bin, serving string, args ...string) []string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	// A program that never says so is killed, which ends the scan below.
	said := make(chan struct{})
	go func() {
		select {
		case <-said:
		case <-time.After(time.Minute):
			_ = cmd.Process.Kill()
		}
	}()
	defer close(said)
	re := regexp.MustCompile(serving)
	var log []string
	for lines := bufio.NewScanner(stderr); lines.Scan(); {
		if m := re.FindStringSubmatch(lines.Text()); m != nil {
			go func() { _, _ = io.Copy(io.Discard, stderr) }()
			return m
		}
		log = append(log, lines.Text())
	}
	t.Fatalf("%s exited, or did not serve within a minute, without a line matching %s:\n%s", filepath.Base(bin), serving, strings.Join(log, "\n"))
	return nil
}

// Metric reads one series (name and labels as exposed) of a program's /metrics at addr.
func Metric(t testing.TB, addr, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no series %s", series)
	return 0
}
