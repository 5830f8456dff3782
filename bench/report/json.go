package report

import (
	"encoding/json"
	"os"
	"path/filepath"
)

// SaveJSON writes v, indented, to dir/name, creating dir.
func SaveJSON(dir, name string, v any) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, name), append(b, '\n'), 0o644)
}

// Save writes a benchmark's report: v as dir/name.json and the CDF of series as
// dir/name.png.
func Save(dir, name string, v any, title, xlabel string, series []Series, markers ...Marker) error {
	if err := SaveJSON(dir, name+".json", v); err != nil {
		return err
	}
	return CDF(filepath.Join(dir, name+".png"), title, xlabel, series, markers...)
}
