package discovery

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"

	"github.com/kvhandoff/kvhandoff/internal/kubeconfig"
)

// Flags are the command-line flags that name a program's engines: a DecodePool in a
// cluster, or a file outside one.
type Flags struct {
	endpoints, pool, namespace, kubeconfig string
}

// AddFlags adds the engine-source flags to fs.
func AddFlags(fs *flag.FlagSet) *Flags {
	f := &Flags{}
	fs.StringVar(&f.endpoints, "endpoints", "", "JSON file of engines (outside a cluster); re-read when it changes")
	fs.StringVar(&f.pool, "decode-pool", "", "DecodePool to route to (in a cluster)")
	fs.StringVar(&f.namespace, "namespace", "", "namespace of the DecodePool")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig (default: in-cluster)")
	return f
}

// Source is the source the flags name, or an error naming the flag at fault.
func (f *Flags) Source(log *slog.Logger) (Source, error) {
	switch {
	case f.endpoints != "" && f.pool != "":
		return nil, errors.New("--endpoints and --decode-pool exclude each other: one source of engines")
	case f.endpoints != "":
		if _, err := ReadFile(f.endpoints); err != nil {
			return nil, fmt.Errorf("--endpoints: %w", err)
		}
		return &File{Path: f.endpoints, Log: log}, nil
	case f.pool != "":
		if f.namespace == "" {
			return nil, errors.New("--namespace is required with --decode-pool")
		}
		rc, err := kubeconfig.Load(f.kubeconfig)
		if err != nil {
			return nil, err
		}
		return &Cluster{Config: rc, Namespace: f.namespace, DecodePool: f.pool, Log: log}, nil
	}
	return nil, errors.New("name the engines: --decode-pool and --namespace in a cluster, or --endpoints FILE")
}
