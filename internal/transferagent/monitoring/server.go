// Package monitoring serves the transfer agent's /metrics, /healthz and /readyz.
package monitoring

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"
	"sigs.k8s.io/controller-runtime/pkg/certwatcher"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
)

// Options says what to serve and how.
type Options struct {
	// Addr is the TCP address to listen on.
	Addr string
	// Gatherer holds the metrics.
	Gatherer prometheus.Gatherer
	// Ready reports readiness; its text follows "ok: " on /readyz.
	Ready func() (string, error)
	// Secure serves HTTPS and /metrics only to callers the API server authenticates (a
	// bearer token, by TokenReview) and authorizes to get /metrics (SubjectAccessReview),
	// as the manager does. The probes stay open: the kubelet sends no credentials, and
	// they reveal nothing.
	Secure bool
	// CertDir holds tls.crt and tls.key, reloaded when they change; empty: a self-signed
	// certificate made at start (scrapers then skip verification, as they do for
	// kube-controller-manager's).
	CertDir string
	// Kube is the API server the Secure checks ask; required when Secure.
	Kube *rest.Config
}

// Start listens on o.Addr and serves until ctx ends; it returns the bound address.
func Start(ctx context.Context, o Options, log *slog.Logger) (string, error) {
	metrics := promhttp.HandlerFor(o.Gatherer, promhttp.HandlerOpts{})
	var tlsConfig *tls.Config
	if o.Secure {
		if o.Kube == nil {
			return "", errors.New("secure metrics need a Kubernetes API server to authenticate and authorize callers")
		}
		hc, err := rest.HTTPClientFor(o.Kube)
		if err != nil {
			return "", err
		}
		filter, err := filters.WithAuthenticationAndAuthorization(o.Kube, hc)
		if err != nil {
			return "", err
		}
		if metrics, err = filter(logr.FromSlogHandler(log.Handler()), metrics); err != nil {
			return "", err
		}
		if tlsConfig, err = serving(ctx, o.CertDir, log); err != nil {
			return "", err
		}
	}

	mux := http.NewServeMux()
	mux.Handle("/metrics", metrics)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		detail, err := o.Ready()
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintf(w, "ok: %s\n", detail)
	})

	ln, err := net.Listen("tcp", o.Addr)
	if err != nil {
		return "", err
	}
	if tlsConfig != nil {
		ln = tls.NewListener(ln, tlsConfig)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	context.AfterFunc(ctx, func() { _ = srv.Close() })
	return ln.Addr().String(), nil
}

// serving returns the TLS configuration: the certificate in dir, watched for renewal,
// or a self-signed one.
func serving(ctx context.Context, dir string, log *slog.Logger) (*tls.Config, error) {
	if dir != "" {
		w, err := certwatcher.New(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
		if err != nil {
			return nil, fmt.Errorf("metrics certificate in %s: %w", dir, err)
		}
		go func() {
			if err := w.Start(ctx); err != nil {
				log.Error("metrics certificate watcher", "err", err)
			}
		}()
		return &tls.Config{GetCertificate: w.GetCertificate, MinVersion: tls.VersionTLS12}, nil
	}
	cert, key, err := certutil.GenerateSelfSignedCertKeyWithFixtures("localhost", []net.IP{{127, 0, 0, 1}}, nil, "")
	if err != nil {
		return nil, err
	}
	pair, err := tls.X509KeyPair(cert, key)
	if err != nil {
		return nil, err
	}
	return &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}, nil
}
