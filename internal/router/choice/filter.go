package choice

import (
	"fmt"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
)

// Pairable returns the prefill and decode engines that share a compat-hash with an
// engine of the other pool (engines in exclude, which failed the request, left out), or
// why there are none.
func Pairable(set *discovery.Set, exclude map[string]bool) (prefill, decode []discovery.Engine, why string) {
	pHashes, dHashes := map[string]bool{}, map[string]bool{}
	for _, p := range set.Prefill {
		if !exclude[p.EngineID] {
			pHashes[p.CompatHash] = true
		}
	}
	for _, d := range set.Decode {
		if !exclude[d.EngineID] {
			dHashes[d.CompatHash] = true
		}
	}
	for _, p := range set.Prefill {
		if !exclude[p.EngineID] && dHashes[p.CompatHash] {
			prefill = append(prefill, p)
		}
	}
	for _, d := range set.Decode {
		if !exclude[d.EngineID] && pHashes[d.CompatHash] {
			decode = append(decode, d)
		}
	}
	switch {
	case len(set.Prefill) == 0:
		why = fmt.Sprintf("no ready prefill engine (%s)", set.Source)
	case len(set.Decode) == 0:
		why = fmt.Sprintf("no ready decode engine (%s)", set.Source)
	case len(pHashes) == 0:
		why = fmt.Sprintf("no other ready prefill engine to retry on (%s: %d prefill engines, all failed this request)", set.Source, len(set.Prefill))
	case len(dHashes) == 0:
		why = fmt.Sprintf("no other ready decode engine to retry on (%s: %d decode engines, all failed this request)", set.Source, len(set.Decode))
	case len(decode) == 0:
		why = fmt.Sprintf("no ready prefill and decode engines share a compat-hash (%s): the pools run different configurations; see the "+
			"DecodePool's Paired condition", set.Source)
	}
	return prefill, decode, why
}

// SameHash is the engines of es with compat-hash hash.
func SameHash(es []discovery.Engine, hash string) []discovery.Engine {
	var out []discovery.Engine
	for _, e := range es {
		if e.CompatHash == hash {
			out = append(out, e)
		}
	}
	return out
}

// SameID is the engine of es with engine id id, alone, or es when none has it.
func SameID(es []discovery.Engine, id string) []discovery.Engine {
	for _, e := range es {
		if e.EngineID == id {
			return []discovery.Engine{e}
		}
	}
	return es
}
