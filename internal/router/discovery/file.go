package discovery

import (
	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"

	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/fsnotify/fsnotify"
)

// File is a Source that reads a Set from a JSON file and reads it again whenever it
// changes, so a local two-engine setup needs no cluster. Every engine in the file counts
// as ready. A file that does not parse or validate is reported and the last good set
// stays in force.
type File struct {
	Path string
	Log  *slog.Logger
}

// ReadFile reads and validates a Set from path.
func ReadFile(path string) (*Set, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	s := &Set{}
	if err := dec.Decode(s); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if err := defaultRouting(data, s.Routing); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	s.Source = path
	return s, nil
}

// defaultRouting gives a file's routing what the API server gives a KVTransferPolicy's:
// the CRD's default of each field the file leaves out (a field it sets, 0 included,
// stays), so that routing read from a file is routing read from a cluster.
func defaultRouting(data []byte, r *kvv1.RoutingSpec) error {
	if r == nil {
		return nil
	}
	var raw struct {
		Routing map[string]json.RawMessage `json:"routing"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return err
	}
	set := func(key string) bool { _, ok := raw.Routing[key]; return ok }
	if !set("decodeChoice") {
		r.DecodeChoice = kvv1.DecodeChoiceLoadOnly
	}
	if !set("prefixSource") {
		r.PrefixSource = kvv1.PrefixSourceKVEvents
	}
	if !set("overlapWeight") {
		r.OverlapWeight = kvv1.DefaultOverlapWeight
	}
	if !set("loadWeight") {
		r.LoadWeight = kvv1.DefaultLoadWeight
	}
	return nil
}

// Run watches the file's folder (editors and ConfigMap mounts replace files rather than
// write them in place, which a watch on the file itself would lose).
func (f *File) Run(ctx context.Context, out chan<- *Set) error {
	log := f.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s, err := ReadFile(f.Path)
	if err != nil {
		return err
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer w.Close()
	if err := w.Add(filepath.Dir(f.Path)); err != nil {
		return err
	}
	send := func(s *Set) bool {
		select {
		case out <- s:
			return true
		case <-ctx.Done():
			return false
		}
	}
	if !send(s) {
		return nil
	}
	last, _ := os.ReadFile(f.Path)
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-w.Errors:
			log.Error("watching the endpoints file", "path", f.Path, "err", err)
		case <-w.Events:
			data, err := os.ReadFile(f.Path)
			if err != nil || bytes.Equal(data, last) {
				continue // removed mid-replace, or an event that changed nothing
			}
			last = data
			s, err := ReadFile(f.Path)
			if err != nil {
				log.Error("the endpoints file is invalid; keeping the last good one", "path", f.Path, "err", err)
				continue
			}
			log.Info("endpoints changed", "path", f.Path, "prefill", len(s.Prefill), "decode", len(s.Decode))
			if !send(s) {
				return nil
			}
		}
	}
}
