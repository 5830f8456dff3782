package render

// The images of kvhandoff's own that the manager renders, when neither its flags nor a
// pool name others: those of the manager's own version. They are variables so that an
// image build stamps its tag into the manager (-ldflags -X, see the Dockerfile).
var (
	// DefaultRouterImage is a DecodePool's router.
	DefaultRouterImage = "ghcr.io/kvhandoff/router:latest"
	// DefaultConnectorImage is the init container that installs the vLLM connector into
	// executor-Agent engines.
	DefaultConnectorImage = "ghcr.io/kvhandoff/vllm-connector:latest"
)
