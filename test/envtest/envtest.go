// Package envtest starts a real kube-apiserver and etcd for the test suites, from the
// binaries hack/control-plane-bins.sh builds from Go modules, and installs kvhandoff's CRDs.
package envtest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvhandoff/kvhandoff/test/loopback"
)

// Env is a running control plane with kvhandoff's CRDs installed.
type Env struct {
	*envtest.Environment
	host   *loopback.Host
	Config *rest.Config
	Scheme *k8sruntime.Scheme
	// Client writes with strict field validation, so a typo in a test object fails loudly
	// instead of being pruned.
	Client client.Client
}

// RepoRoot is the root of the kvhandoff checkout.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Start starts kube-apiserver and etcd, installs the CRDs from config/crd/bases and
// returns a client for scheme s.
func Start(s *k8sruntime.Scheme) (*Env, error) {
	assets, err := Binaries("kube-apiserver", "etcd")
	if err != nil {
		return nil, err
	}
	// On a loopback host of their own with their usual ports: envtest would otherwise
	// give them ports it found free and released, which another process can take first.
	host, err := loopback.Claim()
	if err != nil {
		return nil, err
	}
	etcd := &envtest.Etcd{URL: &url.URL{Scheme: "http", Host: host.Addr(2379)}}
	etcd.Configure().Set("listen-peer-urls", "http://"+host.Addr(2380))
	apiserver := &envtest.APIServer{}
	apiserver.SecureServing.ListenAddr = envtest.ListenAddr{Address: host.IP, Port: "6443"}
	env := &envtest.Environment{
		ControlPlane:          envtest.ControlPlane{Etcd: etcd, APIServer: apiserver},
		CRDDirectoryPaths:     []string{filepath.Join(RepoRoot(), "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: assets,
	}
	e := &Env{Environment: env, host: host, Scheme: s}
	if e.Config, err = env.Start(); err != nil {
		_ = e.Stop()
		return nil, fmt.Errorf("starting kube-apiserver and etcd from %s: %w", assets, err)
	}
	c, err := client.New(e.Config, client.Options{Scheme: s})
	if err != nil {
		_ = e.Stop()
		return nil, err
	}
	e.Client = client.WithFieldValidation(c, "Strict")
	return e, nil
}

// Stop stops kube-apiserver and etcd and gives their loopback host back.
func (e *Env) Stop() error {
	err := e.Environment.Stop()
	return errors.Join(err, e.host.Release())
}

// Binaries returns the folder that holds the named control-plane binaries:
// $KUBEBUILDER_ASSETS when it has them all, or else the cache that
// hack/control-plane-bins.sh fills (building what is missing, once).
func Binaries(names ...string) (string, error) {
	if dir := os.Getenv("KUBEBUILDER_ASSETS"); dir != "" && hasAll(dir, names) {
		return dir, nil
	}
	cmd := exec.Command(filepath.Join(RepoRoot(), "hack", "control-plane-bins.sh"), names...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("building the control-plane binaries %v with hack/control-plane-bins.sh: %w", names, err)
	}
	return strings.TrimSpace(string(out)), nil
}

func hasAll(dir string, names []string) bool {
	for _, n := range names {
		if _, err := os.Stat(filepath.Join(dir, n)); err != nil {
			return false
		}
	}
	return true
}

// Samples reads every object of every file in config/samples, by file name.
func Samples() (map[string][]*unstructured.Unstructured, error) {
	files, err := filepath.Glob(filepath.Join(RepoRoot(), "config", "samples", "*.yaml"))
	if err != nil {
		return nil, err
	}
	out := map[string][]*unstructured.Unstructured{}
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		objs, err := ReadObjects(f)
		if err != nil {
			return nil, err
		}
		out[filepath.Base(f)] = objs
	}
	return out, nil
}

// ReadObjects reads every object of a YAML (or JSON) file of one or more documents.
func ReadObjects(path string) ([]*unstructured.Unstructured, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); errors.Is(err, io.EOF) {
			return out, nil
		} else if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if len(u.Object) > 0 {
			out = append(out, u)
		}
	}
}

// InstallGatewayCRDs installs the Gateway API Inference Extension's InferencePool CRD
// into a running env.
func (e *Env) InstallGatewayCRDs() error { return InstallGatewayCRDs(e.Config) }

// InstallGatewayCRDs installs the InferencePool CRD, from the Go module kvhandoff builds
// against (not a copy), into the cluster of cfg, and waits until it is served.
func InstallGatewayCRDs(cfg *rest.Config) error {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api-inference-extension").Output()
	if err != nil {
		return fmt.Errorf("finding the gateway-api-inference-extension module: %w", err)
	}
	path := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "bases", "inference.networking.k8s.io_inferencepools.yaml")
	_, err = envtest.InstallCRDs(cfg, envtest.CRDInstallOptions{Paths: []string{path}, ErrorIfPathMissing: true})
	return err
}
