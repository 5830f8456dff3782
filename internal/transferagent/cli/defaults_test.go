package cli

import (
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// A KVTransferPolicy timeout has one home, api/v1alpha1/defaults.go; the CRD's schema
// defaults, the agent's flag defaults, the DaemonSet of config/agent and the chart (its
// values and what its template writes) are copies, and this test fails when any one of
// them changes alone. An agent flag set in a manifest would override the API's default
// for every engine that sends no policy, so a manifest may only repeat the constant.
func TestEveryCopyOfTheTimeoutDefaultsAgreesWithTheAPI(t *testing.T) {
	type timeout struct {
		field, flag, value string // CRD spec field, agent flag, chart value
		want               time.Duration
	}
	timeouts := []timeout{
		{"leaseSeconds", "lease", "lease", kvv1.DefaultLeaseSeconds * time.Second},
		{"registrationTimeoutSeconds", "registration-timeout", "registrationTimeout", kvv1.DefaultRegistrationTimeoutSeconds * time.Second},
		{"blocksTTLSeconds", "blocks-ttl", "blocksTTL", kvv1.DefaultBlocksTTLSeconds * time.Second},
	}
	root := repoRoot(t)
	crd := policySpecSchema(t, filepath.Join(root, "config", "crd", "bases", "kvhandoff.io_kvtransferpolicies.yaml"))
	o, err := parse(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	flags := map[string]time.Duration{"lease": o.agent.Lease, "registration-timeout": o.agent.RegistrationTimeout, "blocks-ttl": o.agent.BlocksTTL}
	values := chartAgentValues(t, filepath.Join(root, "charts", "kvhandoff", "values.yaml"))
	manifests := map[string]string{}
	for _, f := range []string{"config/agent/daemonset.yaml", "charts/kvhandoff/templates/agent.yaml"} {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		manifests[f] = string(b)
	}

	for _, c := range timeouts {
		prop, ok := crd.Properties[c.field]
		switch {
		case !ok || prop.Default == nil:
			t.Errorf("CRD: spec.%s has no default", c.field)
		case string(prop.Default.Raw) != strconv.Itoa(int(c.want/time.Second)):
			t.Errorf("CRD: spec.%s defaults to %s, the API's constant is %d", c.field, prop.Default.Raw, int(c.want/time.Second))
		}
		if flags[c.flag] != c.want {
			t.Errorf("transfer-agent --%s defaults to %s, the API's constant is %s", c.flag, flags[c.flag], c.want)
		}
		if v := values[c.value]; v != "" {
			if d, err := time.ParseDuration(v); err != nil || d != c.want {
				t.Errorf("charts/kvhandoff/values.yaml: agent.%s is %q; leave it empty (the agent's default) or set the API's %s", c.value, v, c.want)
			}
		}
		literal := regexp.MustCompile(`--` + c.flag + `=([0-9a-z.]+)`)
		for f, text := range manifests {
			for _, m := range literal.FindAllStringSubmatch(text, -1) {
				if d, err := time.ParseDuration(m[1]); err != nil || d != c.want {
					t.Errorf("%s sets %s, the API's default is %s: drop the flag (the binary's default is the API's)", f, m[0], c.want)
				}
			}
		}
	}
}

func repoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// policySpecSchema is the schema of spec in the KVTransferPolicy CRD at path.
func policySpecSchema(t *testing.T, path string) apiextensionsv1.JSONSchemaProps {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var crd apiextensionsv1.CustomResourceDefinition
	if err := yaml.Unmarshal(b, &crd); err != nil {
		t.Fatal(err)
	}
	if len(crd.Spec.Versions) == 0 || crd.Spec.Versions[0].Schema == nil {
		t.Fatalf("%s: no schema", path)
	}
	return crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"]
}

// chartAgentValues are the agent's string values in the chart's values.yaml.
func chartAgentValues(t *testing.T, path string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Agent map[string]any `json:"agent"`
	}
	if err := yaml.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for k, x := range v.Agent {
		if s, ok := x.(string); ok {
			out[k] = s
		}
	}
	return out
}
