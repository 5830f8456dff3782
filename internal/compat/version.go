package compat

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// Version is a vLLM release, major.minor.patch.
type Version struct{ Major, Minor, Patch int }

func (v Version) String() string { return fmt.Sprintf("v%d.%d.%d", v.Major, v.Minor, v.Patch) }

// Less reports whether v is older than o.
func (v Version) Less(o Version) bool {
	if v.Major != o.Major {
		return v.Major < o.Major
	}
	if v.Minor != o.Minor {
		return v.Minor < o.Minor
	}
	return v.Patch < o.Patch
}

var (
	// MinSafeVersion: earlier vLLM releases execute code from a model at load time
	// (CVE-2026-22807, CVSS 8.8).
	MinSafeVersion = Version{0, 14, 0}
	// MinPushVersion is the first vLLM release with the push connector.
	MinPushVersion = Version{0, 26, 0}
	// MinAgentVersion and MaxAgentMinor bound the vLLM releases kvhandoff's connector
	// (executor Agent) is tested with, 0.26.0 through 0.34.x: the connector's contract test
	// checks each release's connector hooks. A newer minor release may change them (0.34
	// changed how CUDA KV is allocated), so it is refused until tested.
	MinAgentVersion = Version{0, 26, 0}
	MaxAgentMinor   = Version{0, 34, 0}
	// MinAgentHostKVVersion is the first release that lets the connector allocate the KV
	// cache (its memory pool hook): host KV reaches the agent only as the memfd the
	// connector allocates, so CPU engines need it. GPU KV from older releases is named by
	// legacy CUDA IPC handles instead.
	MinAgentHostKVVersion = Version{0, 31, 0}
)

// AgentSupports reports whether kvhandoff's connector is tested with vLLM v.
func AgentSupports(v Version) bool {
	return !v.Less(MinAgentVersion) && v.Major == MaxAgentMinor.Major && v.Minor <= MaxAgentMinor.Minor
}

// AgentRange names the connector's tested vLLM releases.
func AgentRange() string {
	return fmt.Sprintf("%s through v%d.%d.x", MinAgentVersion, MaxAgentMinor.Major, MaxAgentMinor.Minor)
}

var tagVersion = regexp.MustCompile(`^v?(\d+)\.(\d+)(?:\.(\d+))?(?:$|[-+._])`)

// ImageVersion reads the vLLM version from an image reference's tag
// (vllm/vllm-openai:v0.29.0, registry:5000/vllm:0.29.0-cu130). ok is false when the
// reference has no tag (digest only) or the tag is not a version (latest, nightly).
func ImageVersion(image string) (v Version, ok bool) {
	ref, _, _ := strings.Cut(image, "@")
	slash := strings.LastIndex(ref, "/")
	colon := strings.LastIndex(ref, ":")
	if colon <= slash {
		return Version{}, false
	}
	m := tagVersion.FindStringSubmatch(ref[colon+1:])
	if m == nil {
		return Version{}, false
	}
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	if m[3] != "" {
		v.Patch, _ = strconv.Atoi(m[3])
	}
	return v, true
}
