# kvhandoff — build, generate, test and demo. `make help` lists the targets.

SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

CACHE ?= $(HOME)/.cache/kvhandoff
LOCALBIN ?= $(CURDIR)/bin
CONTROLLER_TOOLS_VERSION ?= v0.23.0
CONTROLLER_GEN ?= $(LOCALBIN)/controller-gen
PROTOC_GEN_GO_VERSION ?= v1.36.12
PROTOC_GEN_GO_GRPC_VERSION ?= v1.6.2
PROTOC_GEN_GO ?= $(LOCALBIN)/protoc-gen-go
PROTOC_GEN_GO_GRPC ?= $(LOCALBIN)/protoc-gen-go-grpc
PY_API := vllm-connector/kvhandoff_vllm/_api
# go-nvml's header marks some NVML calls deprecated; the warnings say nothing about kvhandoff.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

.PHONY: all
all: build

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} /^[a-zA-Z_0-9-]+:.*?##/ { printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2 } /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Development

.PHONY: manifests
manifests: controller-gen ## Generate CRDs and RBAC from the markers in api/ and internal/controller/ (and copy them into the Helm chart).
	$(CONTROLLER_GEN) rbac:roleName=kvhandoff-manager crd:generateEmbeddedObjectMeta=true paths="./..." output:crd:artifacts:config=config/crd/bases
	hack/chart-sync.sh

.PHONY: generate
generate: controller-gen ## Generate DeepCopy methods for the API types.
	$(CONTROLLER_GEN) object paths="./..."

.PHONY: proto
proto: protoc-gen-go ## Generate the transfer agent's engine API (Go, and Python for the vLLM connector) from transferagent/api/v1/agent.proto.
	protoc --plugin=protoc-gen-go=$(PROTOC_GEN_GO) --plugin=protoc-gen-go-grpc=$(PROTOC_GEN_GO_GRPC) \
		--go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative \
		transferagent/api/v1/agent.proto
	"$$(hack/python-venv.sh vllm-connector/requirements-tools.txt)/bin/python" -m grpc_tools.protoc -Itransferagent/api/v1 \
		--python_out=$(PY_API) --grpc_python_out=$(PY_API) transferagent/api/v1/agent.proto
	sed -i 's/^import agent_pb2 as agent__pb2/from . import agent_pb2 as agent__pb2/' $(PY_API)/agent_pb2_grpc.py

.PHONY: fmt
fmt: ## go fmt the module.
	go fmt ./...

.PHONY: vet
vet: ## gofmt-clean, and go vet the module, the GPU tests included (they compile everywhere, run with test-gpu).
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	go vet ./...
	go vet -tags gpu ./internal/transferagent/cuda/ ./test/agent/

.PHONY: verify-generated
verify-generated: controller-gen protoc-gen-go ## Fail when committed generated files differ from a fresh generation.
	CONTROLLER_GEN=$(CONTROLLER_GEN) PROTOC_GEN_GO=$(PROTOC_GEN_GO) PROTOC_GEN_GO_GRPC=$(PROTOC_GEN_GO_GRPC) hack/verify-generated.sh

CLUSTER_BINS := kube-apiserver etcd kube-controller-manager kube-scheduler kwok kubectl kubelet kube-proxy
E2E_CLUSTER_DIR ?= $(CACHE)/e2e-cluster

.PHONY: deps
deps: ## Install what the tests need: apt packages, control-plane binaries (cached under ~/.cache/kvhandoff).
	hack/install-deps.sh $(CLUSTER_BINS)

# The real node is named first: go test starts packages in the order named, two at a time on
# two cores; named last, the longest suite set the tier's wall time; named first, the others run beside it.
.PHONY: test
test: deps verify-generated vet ## Run every test tier: unit, envtest, e2e on the simulated cluster, the real node (pods from images built here), the kubelet's device manager, real vLLM.
	KUBEBUILDER_ASSETS="$$(hack/control-plane-bins.sh $(CLUSTER_BINS))" go test ./test/realnode ./... -count=1 -timeout 45m
	$(MAKE) test-kubelet
	$(MAKE) test-vllm

.PHONY: unit
unit: ## The loop to run while editing: every Go test that needs no API server, agent process, root or vLLM (hack/unit-packages.sh lists them).
	go test $$(hack/unit-packages.sh) -count=1 -timeout 10m

.PHONY: test-gpu
# On a host with two NVIDIA GPUs (KVH_CUDA_PEER=0: within one): the CUDA layer (memory passed as fds into another PID namespace, IPC across processes), push, pull
# and cancels between engines whose KV is GPU memory, and the vLLM connector's CUDA KV through the agent.
test-gpu: ## GPU tests on an NVIDIA host; results in bench/results/gpu/.
	mkdir -p bench/results/gpu
	KVH_GPU_OUT=$(CURDIR)/bench/results/gpu go test -tags gpu -count=1 -v ./internal/transferagent/cuda/
	go test -tags gpu -count=1 -v -run '^TestGPU(PushAndPull|Cancel|DifferentTensor)' ./test/agent/
	go build -o bin/ ./cmd/transfer-agent
	venv="$$(hack/python-venv.sh vllm-connector/requirements-test.txt)" && cd vllm-connector && \
		KVHANDOFF_BIN_DIR=$(CURDIR)/bin "$$venv/bin/python" -m pytest -q -p no:cacheprovider gpu_tests

KVH_GPU_PARTS ?= .gpu
KVH_GPU_DIR ?= /tmp/kvh-gpu
GPU_VLLM_ENV := PYTHONPATH=$(KVH_GPU_DIR)/site KVHANDOFF_BIN_DIR=$(KVH_GPU_DIR)/bin KVH_CUDA_PEER=0 PYTHONUNBUFFERED=1

.PHONY: gpu-vllm-set
gpu-vllm-set: ## The GPU tier's set for a GPU host without network (vLLM 0.26.0 trimmed, the packages it lacks there, stock NIXL 1.5.1, the agent and router): $(KVH_GPU_PARTS)/part-*, 58 MiB each.
	hack/gpu-vllm.sh pack $(KVH_GPU_PARTS)

.PHONY: test-gpu-vllm
# On the GPU host, with the set's parts in $(KVH_GPU_PARTS): needs nothing from the network.
test-gpu-vllm: ## Real vLLM 0.26 engines on GPU 0 handing KV through the agent (push, push-layered, pull: token for token), the connector's CUDA KV kinds.
	hack/gpu-vllm.sh install $(KVH_GPU_PARTS)
	cd vllm-connector && $(GPU_VLLM_ENV) python3 -m pytest -v -p no:cacheprovider gpu_tests

.PHONY: bench-vllm-gpu
bench-vllm-gpu: ## After test-gpu-vllm: one engine alone against kvhandoff push, push-layered and pull and stock NIXL pull and push, on one seeded load of 16k-token prompts (Qwen3-8B-shaped; SHAPE=qwen3-1.7b for sweeps); QPS a rate or a comma-separated sweep, CONFIGS a subset, KV_GIB and GPU_SHARE per engine (defaults fit an 80 GB GPU), SERVED=1 for engines as vLLM is served (full CUDA graphs for decode); bench/results/gpu/.
	cd vllm-connector && $(GPU_VLLM_ENV) python3 bench/bench_vllm.py --gpu --out ../bench/results/gpu --requests $${REQUESTS:-20} --qps $${QPS:-0.5} \
		--kv-gib $${KV_GIB:-12} --gpu-share $${GPU_SHARE:-0.45} --shape "$${SHAPE:-}" --configs "$${CONFIGS:-}" $${SERVED:+--served}

.PHONY: bench-handoff-gpu
# Push and pull handoffs of Qwen3-32B's KV (16k tokens, one TP-8 rank) against raw copies of the same bytes.
bench-handoff-gpu: ## GPU handoffs against raw copies on two NVIDIA GPUs; bench/results/gpu/handoff.json.
	mkdir -p bench/results/gpu
	KVH_GPU_OUT=$(CURDIR)/bench/results/gpu go test -tags gpu -count=1 -v -run '^TestGPUHandoffAgainstARawCopy$$' ./test/agent/

.PHONY: test-kubelet
test-kubelet: ## The device plugin against the kubelet's own device manager (its own module; needs root for a private mount namespace).
	cd test/kubelet && go vet ./... && go test ./... -count=1 -timeout 10m

.PHONY: test-vllm
test-vllm: ## The vLLM connector: its hooks against every supported vLLM release's source, its scheduler side in vLLM 0.32's and 0.34's Scheduler, real vLLM engines through the agents (push and pull), and stock NIXL engines behind the router.
	go build -o bin/ ./cmd/transfer-agent ./cmd/router ./cmd/kv-events
	venv="$$(hack/python-venv.sh vllm-connector/requirements-test.txt)" && nixl="$$(hack/nixl.sh)" && cd vllm-connector && \
		PYTHONPATH="$$nixl" KVHANDOFF_BIN_DIR=$(CURDIR)/bin KVHANDOFF_VLLM_REPORT=$(CURDIR)/bin/vllm-report.json \
		"$$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=12 tests --ignore tests/test_vllm034.py
	@cat bin/vllm-report.json
	venv="$$(hack/python-venv.sh vllm-connector/requirements-vllm034.txt)" && cd vllm-connector && \
		"$$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_scheduler.py tests/test_vllm034.py

.PHONY: e2e
e2e: deps ## Run the end-to-end suite: against $$KUBECONFIG when set, else on a fresh simulated cluster.
	KUBEBUILDER_ASSETS="$$(hack/control-plane-bins.sh $(CLUSTER_BINS))" go test ./test/e2e -count=1 -timeout 30m -v -ginkgo.v

.PHONY: e2e-cluster-up
e2e-cluster-up: deps ## Start the simulated cluster in the background; prints the KUBECONFIG to use.
	hack/e2e-cluster.sh up $(E2E_CLUSTER_DIR)

.PHONY: e2e-cluster-down
e2e-cluster-down: ## Stop the simulated cluster started by e2e-cluster-up.
	hack/e2e-cluster.sh down $(E2E_CLUSTER_DIR)

##@ Build

.PHONY: build
build: ## Build the binaries into bin/.
	go build -o $(LOCALBIN)/ ./cmd/...

VERSION ?= dev
.PHONY: images
images: ## Build the images without Docker (hack/images: Debian bases by mmdebstrap) into bin/images/<name>.tar, tagged ghcr.io/kvhandoff/<name>:$(VERSION).
	hack/install-deps.sh >/dev/null
	go run ./hack/images -version $(VERSION) -out $(LOCALBIN)/images

.PHONY: bench-handoff
bench-handoff: deps ## Handoff benchmark (push, push-layered, pull; the agent against fi_rma_bw): table, bench/results/handoff.json and handoff.png.
	go run ./bench/cmd/bench-handoff --out bench/results --fabtests "$$(hack/fabtests.sh)"

.PHONY: bench-vllm
bench-vllm: deps ## Real vLLM engines on one seeded load: one engine alone, stock NIXL pull and push, kvhandoff pull and push; bench/results/vllm/.
	go build -o bin/ ./cmd/transfer-agent ./cmd/router ./cmd/kv-events
	venv="$$(hack/python-venv.sh vllm-connector/requirements-test.txt)" && nixl="$$(hack/nixl.sh)" && \
		PYTHONPATH="$$nixl" KVHANDOFF_BIN_DIR=$(CURDIR)/bin "$$venv/bin/python" vllm-connector/bench/bench_vllm.py --out bench/results/vllm

.PHONY: bench-serving
bench-serving: deps ## Router under load, push vs pull on the same arrivals: table, bench/results/serving.json and serving.png.
	go run ./bench/cmd/bench-serving --out bench/results

.PHONY: bench-prefix
bench-prefix: deps ## Prefix-aware routing report: 200 conversations of 5 turns through the router to simulated engines with prefix caches, load-only against prefix-aware in push and pull (about 8 minutes); bench/results/prefix/.
	go run ./bench/cmd/bench-prefix --out bench/results/prefix

.PHONY: bench-prefix-vllm
bench-prefix-vllm: deps ## Prefix-aware routing with real vLLM CPU engines: multi-turn conversations, load-only against prefix-aware in push and pull (about 10 minutes); bench/results/prefix/vllm-cpu.md.
	go build -o bin/ ./cmd/transfer-agent ./cmd/router ./cmd/kv-events
	venv="$$(hack/python-venv.sh vllm-connector/requirements-test.txt)" && \
		KVHANDOFF_BIN_DIR=$(CURDIR)/bin "$$venv/bin/python" vllm-connector/bench/bench_prefix.py --out bench/results/prefix

.PHONY: bench-kv-events
bench-kv-events: deps ## Where the prefix index comes from, with two router replicas and real vLLM CPU engines: routing history against the engines' KV cache events, on the same token-id conversations (about 5 minutes); bench/results/prefix/vllm-cpu-kv-events.md.
	go build -o bin/ ./cmd/transfer-agent ./cmd/router ./cmd/kv-events
	venv="$$(hack/python-venv.sh vllm-connector/requirements-test.txt)" && \
		KVHANDOFF_BIN_DIR=$(CURDIR)/bin "$$venv/bin/python" vllm-connector/bench/bench_kv_events.py --out bench/results/prefix

.PHONY: bench-autoscale
bench-autoscale: deps ## Autoscaling report: the stepped load on a real node, autoscaled against each static split of its budget (about 25 minutes); bench/results/autoscale/.
	mkdir -p bench/results/autoscale
	KVHANDOFF_AUTOSCALE_REPORT=$(CURDIR)/bench/results/autoscale KUBEBUILDER_ASSETS="$$(hack/control-plane-bins.sh $(CLUSTER_BINS))" \
		go test ./test/realnode -run '^$$' -bench SteppedLoadAgainstStaticSplits -benchtime 1x -timeout 60m -v

.PHONY: chaos-report
chaos-report: deps ## The fault suite on a real node (make test runs it too), its table written to bench/results/chaos/ (about 9 minutes on 2 cores).
	mkdir -p bench/results/chaos
	KVHANDOFF_CHAOS_REPORT=$(CURDIR)/bench/results/chaos KUBEBUILDER_ASSETS="$$(hack/control-plane-bins.sh $(CLUSTER_BINS))" \
		go test ./test/realnode -run '^TestFaultsCostOnlyWhatWasInFlight$$' -count=1 -timeout 30m -v

.PHONY: demo
demo: deps ## Start a local control plane, install the CRDs, apply the samples and show them.
	hack/demo.sh

##@ Tools

.PHONY: controller-gen
controller-gen: $(CONTROLLER_GEN) ## Build controller-gen (cached under ~/.cache/kvhandoff/tools).
$(CONTROLLER_GEN):
	hack/go-install.sh controller-gen sigs.k8s.io/controller-tools/cmd/controller-gen $(CONTROLLER_TOOLS_VERSION) $@

.PHONY: protoc-gen-go
protoc-gen-go: $(PROTOC_GEN_GO) $(PROTOC_GEN_GO_GRPC) ## Build the protoc plugins (cached under ~/.cache/kvhandoff/tools).
$(PROTOC_GEN_GO):
	hack/go-install.sh protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go $(PROTOC_GEN_GO_VERSION) $@
$(PROTOC_GEN_GO_GRPC):
	hack/go-install.sh protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc $(PROTOC_GEN_GO_GRPC_VERSION) $@
