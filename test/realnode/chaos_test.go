package realnode_test

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// The fleet under faults. A push and a pull pair, each of two prefill and two decode
// simulated engines (their speed follows their load) behind two routers, serve a steady
// load through their router Service while one fault at a time hits them. For each fault
// the test asserts what a user of the fleet is owed:
//   - failures ≤ the requests in flight on the faulted part at the fault, counted from
//     the routers' own records (their request logs, or a router's in-flight gauge), every
//     failure with a status and a message naming its cause, none hung; where the fault
//     leaves no pair that can serve (the node's one agent), those arriving before the
//     replacement serves may fail too, at once and by name, and none after;
//   - capacity back: within 30 s of the replacement serving, a 5 s stretch of the load is
//     served whole at the pre-fault rate;
//   - nothing leaked, within the policy's lease and TTL: every agent holds no request
//     (kvhandoff_agent_held_requests), every engine rank has its session again, every
//     engine's KV cache is empty again, the agent's RSS is near its baseline, and every
//     engine answers a request of its own (no engine Ready but wedged);
//   - the status tells: the condition that names the fault goes False during it and
//     every pool is Ready and TransferHealthy after.
//
// KVHANDOFF_CHAOS_REPORT=dir writes the table (report.md, report.json) there: make
// chaos-report puts it in bench/results/chaos/.
func TestFaultsCostOnlyWhatWasInFlight(t *testing.T) {
	onThisMachine(t) // the engine kills find the containers' processes on this machine
	n, cs := startNode(t, "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", "envoy", realnode.SimEngines.Image)
	// Before the manager starts, so that it watches InferencePools.
	if err := n.InstallGatewayCRDs(); err != nil {
		t.Fatal(err)
	}
	if err := n.InstallChart(append(n.ChartValues(), realnode.PlainMetrics, fmt.Sprintf(`agent.healthWindow="%ds"`, chaosHealthWindow))...); err != nil {
		t.Fatal(err)
	}
	modes := []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull}
	for _, mode := range modes {
		pol, prefill, decode := realnode.PairObjects(realnode.LoadFollowingEngines, mode)
		pol.Spec.LeaseSeconds, pol.Spec.RegistrationTimeoutSeconds, pol.Spec.BlocksTTLSeconds = chaosLease, chaosTTL, chaosTTL
		pol.Spec.HealthWindowSeconds = ptr.To[int32](chaosHealthWindow)
		prefill.Spec.Replicas, decode.Spec.Replicas, decode.Spec.Router.Replicas = ptr.To[int32](2), ptr.To[int32](2), ptr.To[int32](2)
		// The push pair is behind Envoy and its endpoint picker too (two replicas).
		decode.Spec.Gateway.InferencePool = mode == kvv1.TransferPush
		if err := n.Create(bg, pol, prefill, decode); err != nil {
			t.Fatal(err)
		}
	}
	var rows []chaosRow
	for _, mode := range modes {
		m := strings.ToLower(string(mode))
		waitPair(t, n, m)
		if mode == kvv1.TransferPush {
			if _, err := n.StartGateway(bg, m, realnode.SimEngines.Model, 2*time.Minute); err != nil {
				t.Fatal(err)
			}
		}
		// A first load warms the agent up: its RSS after is the level a fault must
		// leave it at, not its size before it served anything.
		warm, err := n.StartLoad(m, chaosLoad)
		if err != nil {
			t.Fatal(err)
		}
		until(t, m+": 40 requests served to warm up", time.Minute, func() bool { return served(warm.Results()) >= 40 })
		warm.Stop()
		for _, f := range chaosFaults {
			if f.only == "" || f.only == m {
				t.Run(m+"/"+f.name, func(t *testing.T) { rows = append(rows, runFault(t, n, cs, m, f)) })
			}
		}
	}
	report(t, rows)
}

// The pairs' policy: a short lease and TTL, so what a fault strands is let go quickly
// (the defaults, 30 s and 480 s, would hold it for minutes); and short health windows
// (routers and agents), so the status is all-clear soon after the last failure (the
// defaults, a minute, would wait that long after each fault).
const (
	chaosLease        = 5
	chaosTTL          = 20
	chaosHealthWindow = 15
)

// chaosLoad is the steady load: 4 requests a second of 100 words with 30-token answers,
// about 1.4 in flight per decode engine.
var chaosLoad = realnode.Phase{Name: "steady", Rate: 4, Prompt: 100, Answer: 30}

// A chaosFault hits one part of a mode's pair. do returns what it hit and how many
// requests were in flight on it, from the routers' records (inFlight reads them after the
// load stopped, at the fault's time); back waits until the part's replacement serves.
type chaosFault struct {
	name string
	do   func(t *testing.T, f *faulting) string
	// inFlight counts the requests a router's record shows in flight at the fault on
	// the part hit (victim: its engine id, for engines).
	inFlight func(t *testing.T, f *faulting, victim string) int
	back     func(t *testing.T, f *faulting, victim string)
	// says is the condition (type/reason) that must go False during the fault; "" for
	// none.
	says string
	// outage: the fault leaves no pair that can serve until its replacement does (the
	// node's one agent: every engine here hands over through it). Requests arriving in
	// that window fail too; they must fail at once and by name, and none after it.
	outage bool
	// only names the one mode whose run has the fault ("": both): a part both pairs
	// share, hit once.
	only string
	// viaGateway sends the load through Envoy in front of the mode's DecodePool, its
	// endpoint picker choosing the engines, instead of through its router Service.
	viaGateway bool
	// holds is how much longer than hung a failure may take: what a transfer posted
	// cannot be fenced until it completes or fails, so a request failing in a network
	// cut is answered only once the network is back (its blocks are not freed while a
	// late write or read could still land in them).
	holds time.Duration
}

// faulting is one fault's run: the node, the mode, and what the fault's functions share.
type faulting struct {
	n    *realnode.Node
	cs   *kubernetes.Clientset
	mode string
	// at and after bound the fault's action (a kill, a delete): a request in flight at
	// any moment of it is in flight at the fault.
	at, after time.Time
	// victim and restarts are the killed engine's pod and its engine container's
	// restarts before the kill.
	victim   string
	restarts int32
	// partInFlight is the requests the part hit counted in flight just before it was
	// deleted (a router's or an endpoint picker's gauge).
	partInFlight int
	// evicted are the engine ids of the engines a drain evicted.
	evicted map[string]bool
}

var prefillKilled = chaosFault{
	name: "prefill engine killed (SIGKILL)",
	do:   func(t *testing.T, f *faulting) string { return killEngine(t, f, kvv1.RolePrefill) },
	inFlight: func(t *testing.T, f *faulting, victim string) int {
		return f.loggedInFlight(t, func(r routerRecord) bool { return r.Prefill == victim || r.Retries > 0 })
	},
	back: func(t *testing.T, f *faulting, _ string) { restarted(t, f, kvv1.RolePrefill) },
	says: kvv1.ConditionReady,
}

var chaosFaults = []chaosFault{
	prefillKilled,
	{
		name: "decode engine killed (SIGKILL)",
		do:   func(t *testing.T, f *faulting) string { return killEngine(t, f, kvv1.RoleDecode) },
		inFlight: func(t *testing.T, f *faulting, victim string) int {
			return f.loggedInFlight(t, func(r routerRecord) bool { return r.Decode == victim })
		},
		back: func(t *testing.T, f *faulting, _ string) { restarted(t, f, kvv1.RoleDecode) },
		says: kvv1.ConditionReady,
	},
	{
		name: "transfer agent pod deleted",
		do: func(t *testing.T, f *faulting) string {
			return deleteOne(t, f, "kvhandoff-node", client.MatchingLabels{"app.kubernetes.io/component": "transfer-agent"})
		},
		// Every request's KV crosses the node's one agent.
		inFlight: func(t *testing.T, f *faulting, _ string) int {
			return f.loggedInFlight(t, func(routerRecord) bool { return true })
		},
		// Back when the new agent serves and the routers can pair engines again; the
		// pools' Ready follows a health window after the last failed handoff.
		back: func(t *testing.T, f *faulting, _ string) {
			until(t, "the agent's replacement to serve", 3*time.Minute, func() bool { return f.n.AgentsServe(bg) && f.routerPairs() })
		},
		says:   kvv1.ConditionTransferHealthy + "/" + kvv1.ReasonAgentNotReady,
		outage: true,
	},
	{
		// A partition between the agent and everything else, the loopback included (on
		// this node its prefill and decode sides share it, their fabric endpoints
		// reaching each other over TCP), for longer than the lease: the writes in flight
		// stall, nothing may land in blocks freed meanwhile (every engine checks its KV
		// byte for byte), and what fails must fail by name.
		name: "agent's network cut for 10 s",
		do: func(t *testing.T, f *faulting) string {
			pods := f.pods(t, "kvhandoff-node", client.MatchingLabels{"app.kubernetes.io/component": "transfer-agent"})
			ports, err := f.n.CutNetwork(bg, pods[0].Namespace, pods[0].Name, "transfer-agent", 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: cut %d TCP ports of the agent for 10 s", f.mode, ports)
			return pods[0].Name
		},
		inFlight: func(t *testing.T, f *faulting, _ string) int {
			return f.loggedInFlight(t, func(routerRecord) bool { return true })
		},
		back: func(t *testing.T, f *faulting, _ string) {
			until(t, "the agent to serve again", 3*time.Minute, func() bool { return f.n.AgentsServe(bg) && f.routerPairs() })
		},
		// The cut, then TCP's retransmission backoff: a segment dropped late in the cut
		// is sent again up to 6.4 s after it ends.
		holds: 10*time.Second + 6400*time.Millisecond,
	},
	{
		name: "router pod deleted",
		do: func(t *testing.T, f *faulting) string {
			pods := f.pods(t, "default", client.MatchingLabels{kvv1.LabelRouter: f.mode + "-decode"})
			f.partInFlight = f.routerInFlight(t, pods[0].Name)
			return deletePod(t, f, &pods[0])
		},
		inFlight: func(_ *testing.T, f *faulting, _ string) int { return f.partInFlight },
		back:     func(t *testing.T, f *faulting, _ string) { waitPair(t, f.n, f.mode) },
	},
	{
		// Through Envoy: each request's ext_proc stream is on one picker replica. The
		// deleted one drains its streams on SIGTERM; Envoy opens the next on the other.
		name: "endpoint picker pod deleted (load through Envoy)",
		do: func(t *testing.T, f *faulting) string {
			pods := f.pods(t, "default", client.MatchingLabels{kvv1.LabelEndpointPicker: f.mode + "-decode"})
			// Picked for a decode engine: a request, counted once.
			f.partInFlight = f.gauge(t, pods[0].Name, render.EPPAdminPort, "kvhandoff_epp_inflight", "decode")
			return deletePod(t, f, &pods[0])
		},
		inFlight: func(_ *testing.T, f *faulting, _ string) int { return f.partInFlight },
		back: func(t *testing.T, f *faulting, _ string) {
			until(t, "the endpoint picker's replacement to be available", 2*time.Minute, func() bool {
				d := &appsv1.Deployment{}
				return f.n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: f.mode + "-decode-epp"}, d) == nil &&
					d.Status.AvailableReplicas == ptr.Deref(d.Spec.Replicas, 1) && d.Status.UpdatedReplicas == d.Status.AvailableReplicas
			})
		},
		viaGateway: true,
		only:       "push",
	},
	{
		// A node drained while it serves, as kubectl drain drains it: cordoned, then each
		// pod of the pair evicted through the Eviction API, which the pools' and the
		// routers' budgets answer. On this one node the evicted pods' replacements have
		// nowhere to go: the budgets must hold each set to one pod evicted, the rest
		// serving, until the node is uncordoned 10 s later.
		name: "node drained (cordon, evictions through the budgets)",
		do:   drain,
		inFlight: func(t *testing.T, f *faulting, _ string) int {
			return f.partInFlight + f.loggedInFlight(t, func(r routerRecord) bool { return f.evicted[r.Prefill] || f.evicted[r.Decode] })
		},
		back: func(t *testing.T, f *faulting, _ string) {
			until(t, "every engine Ready again", 3*time.Minute, func() bool {
				_, p := f.n.Pods(f.mode+"-prefill", kvv1.RolePrefill)
				_, d := f.n.Pods(f.mode+"-decode", kvv1.RoleDecode)
				return p == 2 && d == 2
			})
			waitPair(t, f.n, f.mode)
		},
		only: "push",
	},
	{
		// The control plane goes away (an outage, an upgrade without HA): the routers keep
		// the engines they discovered, the agents the pods they know, so no request may
		// fail; the manager, whose leader lease lapses, restarts and reconciles after.
		name: "API server stopped for 30 s",
		do: func(t *testing.T, f *faulting) string {
			if err := f.n.StopAPIServer(bg, 30*time.Second); err != nil {
				t.Fatal(err)
			}
			return "kube-apiserver"
		},
		inFlight: func(*testing.T, *faulting, string) int { return 0 }, // no request crosses it
		back:     func(t *testing.T, f *faulting, _ string) { waitPair(t, f.n, f.mode) },
		only:     "pull",
	},
	// Then a fault the status must tell: the manager's cache follows the pods
	// again within seconds of the API server's return (package informer). With
	// client-go's back-off its watches could come back a minute later, and an engine
	// that restarted meanwhile was never reported (Ready stayed True).
	afterTheOutage(prefillKilled),
}

func afterTheOutage(f chaosFault) chaosFault {
	f.name += ", just after the API server is back"
	f.only = "pull"
	return f
}

// chaosRow is one fault's record, as the report shows it.
type chaosRow struct {
	Mode, Fault, Victim string
	Requests            int            `json:"requests"`
	InFlight            int            `json:"inFlightOnThePartAtTheFault"`
	Failed              int            `json:"failed"`
	FailedInOutage      int            `json:"failedArrivingWhileNoPairCouldServe"`
	Reasons             map[string]int `json:"failureReasons,omitempty"`
	SlowestSeconds      float64        `json:"slowestInFlightAtTheFaultSeconds"`
	BackSeconds         float64        `json:"replacementServingAfterSeconds"`
	RecoverySeconds     float64        `json:"preFaultRateBackAfterSeconds"`
	LeaksGoneSeconds    float64        `json:"leaksGoneAfterSeconds"`
	Conditions          []string       `json:"conditionsFalseDuringTheFault"`
}

func runFault(t *testing.T, n *realnode.Node, cs *kubernetes.Clientset, mode string, fault chaosFault) chaosRow {
	t.Helper()
	f := &faulting{n: n, cs: cs, mode: mode}
	row := chaosRow{Mode: mode, Fault: fault.name}
	what := mode + ", " + fault.name
	base := f.idle(t, what)
	via := mode + "-decode-router"
	if fault.viaGateway {
		via = mode + "-gateway"
	}
	load, err := n.StartLoadVia(via, mode, chaosLoad)
	if err != nil {
		t.Fatal(err)
	}
	defer load.Stop()
	until(t, what+": 20 requests served before the fault", time.Minute, func() bool { return served(load.Results()) >= 20 })

	seen := f.watchConditions()
	f.at = time.Now()
	row.Victim = fault.do(t, f)
	f.after = time.Now()
	fault.back(t, f, row.Victim)
	back := time.Now()
	row.BackSeconds = back.Sub(f.at).Seconds()
	row.Conditions = seen()

	// Capacity back: the first 5 s stretch from the replacement on whose requests were
	// all served, as many as arrived in the 5 s before the fault, within 30 s.
	pre := arrivedOK(load.Results(), f.at.Add(-5*time.Second), f.at)
	var recovered time.Time
	until(t, what+": a 5 s stretch served whole at the pre-fault rate", 45*time.Second, func() bool {
		rs := load.Results()
		for from := back; from.Add(5*time.Second).Before(time.Now()) && !from.After(back.Add(30*time.Second)); from = from.Add(500 * time.Millisecond) {
			if ok, failed := count(rs, from, from.Add(5*time.Second)); failed == 0 && ok >= pre*9/10 && ok > 0 {
				recovered = from
				return true
			}
		}
		return false
	})
	row.RecoverySeconds = recovered.Sub(back).Seconds()
	if row.RecoverySeconds > 30 {
		t.Errorf("%s: the pre-fault rate came back %.1f s after the replacement served, over 30 s", what, row.RecoverySeconds)
	}
	load.Stop()

	// Failures: bounded by what was in flight on the part, each named, none hung.
	row.InFlight = fault.inFlight(t, f, row.Victim)
	row.Reasons = map[string]int{}
	results := load.Results()
	row.Requests = len(results)
	for _, r := range results {
		if r.At.Before(f.after) && r.End.After(f.at) {
			row.SlowestSeconds = max(row.SlowestSeconds, r.End.Sub(r.At).Seconds())
		}
		if !r.Failed() {
			continue
		}
		row.Failed++
		if fault.outage && !r.At.Before(f.at) && r.At.Before(back) {
			row.FailedInOutage++
		}
		row.Reasons[reason(r)]++
		if !named(r) {
			t.Errorf("%s: a request failed without a named reason: status %d, %q", what, r.Status, r.Err)
		}
		if took := r.End.Sub(r.At); took > hung+fault.holds {
			t.Errorf("%s: a failed request took %s (over %s): %q", what, took, hung+fault.holds, r.Err)
		}
	}
	if row.Failed-row.FailedInOutage > row.InFlight {
		t.Errorf("%s: %d requests failed (%d of them arriving while no pair could serve), over the %d in flight on %s at the fault: %v",
			what, row.Failed, row.FailedInOutage, row.InFlight, row.Victim, row.Reasons)
	}

	// Status: the condition that names the fault went False; all is well after.
	if fault.says != "" && !hasPrefix(row.Conditions, fault.says) {
		t.Errorf("%s: no pool said %s False during the fault (seen: %v)", what, fault.says, row.Conditions)
	}
	f.healthy(t, what)

	// Nothing leaked, within the lease and TTL.
	row.LeaksGoneSeconds = f.noLeaks(t, what, base)
	t.Logf("%s: %+v", what, row)
	return row
}

// hung bounds a failed request: a request in flight on a killed part fails when its
// connection breaks or its lease ends, never at the client's own timeout (2 min).
const hung = 2 * chaosLease * time.Second

// baseline is what an idle fleet shows, which a fault must leave as it was.
type baseline struct {
	sessions float64 // engine ranks registered with the agent
	rss      float64 // the agent's resident memory
}

// idle waits until the fleet is idle and clean (no request held anywhere, every engine's
// KV cache empty) and returns its baseline.
func (f *faulting) idle(t *testing.T, what string) baseline {
	t.Helper()
	var b baseline
	until(t, what+": the fleet idle before the fault", time.Minute, func() bool {
		clean, _ := f.clean()
		m := f.agentMetrics(t)
		b = baseline{sessions: realnode.Sum(m, "kvhandoff_agent_engine_sessions"), rss: realnode.Sum(m, "process_resident_memory_bytes")}
		return clean && b.sessions == engineRanks
	})
	return b
}

// engineRanks is what the node's agent serves: 4 engines of TP 1 in each of two pairs.
const engineRanks = 8

// noLeaks waits, as long as the lease and TTL allow, until nothing a fault stranded is
// held anywhere and every engine answers, and returns how long that took.
func (f *faulting) noLeaks(t *testing.T, what string, base baseline) float64 {
	t.Helper()
	from := time.Now()
	var why string
	limit := time.Duration(chaosLease+chaosTTL) * time.Second
	err := realnode.WaitFor(bg, what+": nothing held", limit, func() bool {
		clean, dirty := f.clean()
		m := f.agentMetrics(t)
		sessions, rss := realnode.Sum(m, "kvhandoff_agent_engine_sessions"), realnode.Sum(m, "process_resident_memory_bytes")
		switch {
		case !clean:
			why = dirty
		case sessions != base.sessions:
			why = fmt.Sprintf("%v engine sessions at the agent, %v before", sessions, base.sessions)
		case rss > base.rss*1.5+32<<20:
			why = fmt.Sprintf("the agent's RSS %.0f MiB, %.0f MiB before", rss/(1<<20), base.rss/(1<<20))
		default:
			return true
		}
		return false
	})
	took := time.Since(from).Seconds()
	if err != nil {
		t.Errorf("%s: still %s %s after the load stopped (the lease and TTL are %d s and %d s)", what, why, limit, chaosLease, chaosTTL)
		return took
	}
	f.probeEngines(t, what)
	return took
}

// clean says whether no agent holds a request and every engine's KV cache is empty,
// and if not, what is held.
func (f *faulting) clean() (bool, string) {
	for _, role := range []string{"prefill", "decode"} {
		v, err := f.n.AgentMetric(`kvhandoff_agent_held_requests{role="` + role + `"}`)
		if err != nil || v != 0 {
			return false, fmt.Sprintf("the agent holding %v %s requests (%v)", v, role, err)
		}
	}
	for _, p := range f.enginePods() {
		m, err := f.n.PodMetrics("default", p.Name, render.HTTPPort)
		if err != nil {
			return false, fmt.Sprintf("engine %s's metrics: %v", p.Name, err)
		}
		if u := realnode.Sum(m, "vllm:kv_cache_usage_perc"); u != 0 {
			return false, fmt.Sprintf("engine %s's KV cache %.1f%% used", p.Name, 100*u)
		}
	}
	return true, ""
}

// probeEngines sends each engine of every pair a request of its own: a Ready engine must
// answer, not sit wedged.
func (f *faulting) probeEngines(t *testing.T, what string) {
	t.Helper()
	for _, p := range f.enginePods() {
		url := f.n.PodURL("default", p.Name, render.HTTPPort, "/v1/chat/completions")
		body := `{"model":"` + realnode.SimEngines.Model + `","max_tokens":4,"messages":[{"role":"user","content":"are you there"}]}`
		resp, err := f.n.HTTPClient(url, 30*time.Second).Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			t.Errorf("%s: engine %s does not answer a probe: %v", what, p.Name, err)
			continue
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%s: engine %s answers a probe %s", what, p.Name, resp.Status)
		}
	}
}

// routerPairs says whether the mode's router Service answers that it can pair engines.
func (f *faulting) routerPairs() bool {
	url, err := f.n.RouterURL(f.mode, "/readyz")
	if err != nil {
		return false
	}
	resp, err := f.n.HTTPClient(url, 5*time.Second).Get(url)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// healthy waits until every pool is Ready and TransferHealthy: HandoffFailures clears a
// health window (chaosHealthWindow) after the last failed handoff.
func (f *faulting) healthy(t *testing.T, what string) {
	t.Helper()
	var last string
	err := realnode.WaitFor(bg, what+": every pool Ready and TransferHealthy", 2*time.Minute, func() bool {
		cs, err := f.conditions()
		if err != nil { // no answer is not an all-clear
			last = err.Error()
			return false
		}
		for _, c := range cs {
			if strings.HasPrefix(c, kvv1.ConditionReady+"/") || strings.HasPrefix(c, kvv1.ConditionTransferHealthy+"/") {
				last = c
				return false
			}
		}
		return true
	})
	if err != nil {
		t.Errorf("%v (last: %s)", err, last)
	}
}

// watchConditions records, until the returned function is called, every condition any
// pool says False (as "type/reason"); the function returns them.
func (f *faulting) watchConditions() func() []string {
	ctx, cancel := context.WithCancel(bg)
	var mu sync.Mutex
	seen := map[string]bool{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for ctx.Err() == nil {
			cs, _ := f.conditions() // while the API server is away there is nothing to see
			for _, c := range cs {
				mu.Lock()
				seen[c] = true
				mu.Unlock()
			}
			select {
			case <-ctx.Done():
			case <-tick.C:
			}
		}
	}()
	return func() []string {
		cancel()
		<-done
		out := make([]string, 0, len(seen))
		for c := range seen {
			out = append(out, c)
		}
		sort.Strings(out)
		return out
	}
}

// conditions are the Ready and TransferHealthy conditions the pools say False, as
// "type/reason".
func (f *faulting) conditions() ([]string, error) {
	var out []string
	add := func(cs []metav1.Condition) {
		for _, typ := range []string{kvv1.ConditionReady, kvv1.ConditionTransferHealthy} {
			if c := meta.FindStatusCondition(cs, typ); c != nil && c.Status != metav1.ConditionTrue {
				out = append(out, typ+"/"+c.Reason)
			}
		}
	}
	ps, ds := &kvv1.PrefillPoolList{}, &kvv1.DecodePoolList{}
	if err := f.n.Client.List(bg, ps, client.InNamespace("default")); err != nil {
		return nil, err
	}
	if err := f.n.Client.List(bg, ds, client.InNamespace("default")); err != nil {
		return nil, err
	}
	for _, p := range ps.Items {
		add(p.Status.Conditions)
	}
	for _, d := range ds.Items {
		add(d.Status.Conditions)
	}
	return out, nil
}

// routerInFlight is the requests a router pod has in flight: a request holds a decode leg
// from its arrival (push) or a prefill leg and then a decode leg (pull), counted once.
func (f *faulting) routerInFlight(t *testing.T, pod string) int {
	roles := []string{"decode"}
	if f.mode == "pull" {
		roles = append(roles, "prefill")
	}
	return f.gauge(t, pod, render.RouterAdminPort, "kvhandoff_router_inflight", roles...)
}

// gauge sums the series of a pod's metric whose role label is one of roles.
func (f *faulting) gauge(t *testing.T, pod string, port int, metric string, roles ...string) int {
	t.Helper()
	m, err := f.n.PodMetrics("default", pod, port)
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for series, v := range m {
		if strings.HasPrefix(series, metric+"{") && slices.ContainsFunc(roles, func(r string) bool { return strings.Contains(series, `role="`+r+`"`) }) {
			sum += v
		}
	}
	return int(sum)
}

// drain cordons the node of the mode's pair and asks the Eviction API to evict each of
// the pair's pods (engines, routers, endpoint pickers), holds the node cordoned for 10 s
// and uncordons it. Each set under a budget must lose exactly one pod, the API refusing
// the rest (429), and the evicted engines' replacements must wait Pending.
func drain(t *testing.T, f *faulting) string {
	t.Helper()
	list := &corev1.PodList{}
	if err := f.n.Client.List(bg, list, client.InNamespace("default")); err != nil {
		t.Fatal(err)
	}
	// Router pods carry the pool label too (the manager caches them): engines are the
	// pods with a role.
	set := func(p *corev1.Pod) string {
		switch pair := f.mode + "-decode"; {
		case p.Labels[kvv1.LabelRouter] == pair:
			return "router " + pair
		case p.Labels[kvv1.LabelEndpointPicker] == pair:
			return "endpoint picker " + pair
		case p.Labels[kvv1.LabelRole] != "" && (p.Labels[kvv1.LabelPool] == f.mode+"-prefill" || p.Labels[kvv1.LabelPool] == pair):
			return "pool " + p.Labels[kvv1.LabelPool]
		}
		return ""
	}
	var pods []corev1.Pod
	for _, p := range list.Items {
		if set(&p) != "" && p.DeletionTimestamp == nil {
			pods = append(pods, p)
		}
	}
	sort.Slice(pods, func(i, j int) bool { return pods[i].Name < pods[j].Name })
	node := &corev1.Node{}
	if err := f.n.Client.Get(bg, client.ObjectKey{Name: pods[0].Spec.NodeName}, node); err != nil {
		t.Fatal(err)
	}
	setUnschedulable(t, f.n, node, true)
	f.evicted = map[string]bool{}
	evicted, refused := map[string]int{}, map[string]int{}
	for _, p := range pods {
		inflight := 0
		if p.Labels[kvv1.LabelRouter] != "" {
			// Read before the eviction: an evicted router's records go with it.
			inflight = f.routerInFlight(t, p.Name)
		}
		err := f.n.Client.SubResource("eviction").Create(bg, &p, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace}})
		switch {
		case err == nil:
			evicted[set(&p)]++
			f.partInFlight += inflight
			if p.Labels[kvv1.LabelRole] != "" {
				f.evicted[render.EngineID(p.Name, p.Namespace)] = true
			}
		case apierrors.IsTooManyRequests(err): // the budget's answer: not now
			refused[set(&p)]++
		default:
			t.Fatalf("evicting %s: %v", p.Name, err)
		}
	}
	// Every set has two pods: its budget lets exactly one go.
	for _, p := range pods {
		if s := set(&p); evicted[s] != 1 {
			t.Errorf("drain: %s lost %d pods at once (%d refused); its budget allows one", s, evicted[s], refused[s])
		}
	}
	t.Logf("drain: evicted %v, refused %v", evicted, refused)
	// The fault's length (not a wait for anything): the replacements have no node to go
	// to, and the budgets keep the rest serving meanwhile.
	time.Sleep(10 * time.Second)
	for pool, role := range map[string]kvv1.Role{f.mode + "-prefill": kvv1.RolePrefill, f.mode + "-decode": kvv1.RoleDecode} {
		if _, ready := f.n.Pods(pool, role); ready != 1 {
			t.Errorf("drain: %s has %d engines Ready on the cordoned node; want the one the budget kept", pool, ready)
		}
	}
	setUnschedulable(t, f.n, node, false)
	return node.Name
}

// setUnschedulable cordons or uncordons node; uncordoned, it returns once the node
// controller has taken its unschedulable taint off (the scheduler places nothing until
// then).
func setUnschedulable(t *testing.T, n *realnode.Node, node *corev1.Node, on bool) {
	t.Helper()
	patch := client.MergeFrom(node.DeepCopy())
	node.Spec.Unschedulable = on
	if err := n.Client.Patch(bg, node, patch); err != nil {
		t.Fatal(err)
	}
	if on {
		return
	}
	until(t, "the node's unschedulable taint to go", time.Minute, func() bool {
		return n.Client.Get(bg, client.ObjectKeyFromObject(node), node) == nil &&
			!slices.ContainsFunc(node.Spec.Taints, func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeUnschedulable })
	})
}

// killEngine SIGKILLs the engine container of the least restarted engine of the mode's
// pool of role (the kubelet's restart back-off doubles with each restart of a container)
// and returns its engine id.
func killEngine(t *testing.T, f *faulting, role kvv1.Role) string {
	t.Helper()
	pool := f.mode + "-" + strings.ToLower(string(role))
	pods := f.pods(t, "default", client.MatchingLabels{kvv1.LabelPool: pool, kvv1.LabelRole: string(role)})
	victim := slices.MinFunc(pods, func(a, b corev1.Pod) int { return cmp.Compare(engineRestarts(&a), engineRestarts(&b)) })
	f.victim, f.restarts = victim.Name, engineRestarts(&victim)
	if _, err := f.n.KillContainer(bg, "default", victim.Name, render.EngineContainer); err != nil {
		t.Fatal(err)
	}
	return engineID(t, f, pool, role, victim.Name)
}

// restarted waits until every engine pod of the mode's pool of role is Ready again
// (the killed one restarted in place) and the pair serves.
func restarted(t *testing.T, f *faulting, role kvv1.Role) {
	t.Helper()
	pool := f.mode + "-" + strings.ToLower(string(role))
	// First the kubelet's record of the restart: until then the killed pod still reads
	// Ready.
	until(t, pool+"'s killed engine to restart and be Ready", 2*time.Minute, func() bool {
		p := &corev1.Pod{}
		if f.n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: f.victim}, p) != nil || engineRestarts(p) <= f.restarts {
			return false
		}
		_, ready := f.n.Pods(pool, role)
		return ready == 2
	})
	waitPair(t, f.n, f.mode)
}

func engineRestarts(p *corev1.Pod) int32 {
	for _, c := range p.Status.ContainerStatuses {
		if c.Name == render.EngineContainer {
			return c.RestartCount
		}
	}
	return 0
}

// engineID is the engine id the pool's status gives pod.
func engineID(t *testing.T, f *faulting, pool string, role kvv1.Role, pod string) string {
	t.Helper()
	var st kvv1.PoolStatus
	if role == kvv1.RolePrefill {
		p := &kvv1.PrefillPool{}
		if err := f.n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: pool}, p); err != nil {
			t.Fatal(err)
		}
		st = p.Status
	} else {
		d := &kvv1.DecodePool{}
		if err := f.n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: pool}, d); err != nil {
			t.Fatal(err)
		}
		st = d.Status
	}
	for _, e := range st.Engines {
		if e.PodName == pod {
			return e.EngineID
		}
	}
	t.Fatalf("%s's status names no engine of pod %s: %+v", pool, pod, st.Engines)
	return ""
}

func deleteOne(t *testing.T, f *faulting, ns string, labels client.MatchingLabels) string {
	t.Helper()
	pods := f.pods(t, ns, labels)
	return deletePod(t, f, &pods[0])
}

func deletePod(t *testing.T, f *faulting, p *corev1.Pod) string {
	t.Helper()
	if err := f.n.Client.Delete(bg, p); err != nil {
		t.Fatal(err)
	}
	return p.Name
}

// pods lists the Ready pods of ns that match labels, at least one.
func (f *faulting) pods(t *testing.T, ns string, labels client.MatchingLabels) []corev1.Pod {
	t.Helper()
	list := &corev1.PodList{}
	if err := f.n.Client.List(bg, list, client.InNamespace(ns), labels); err != nil {
		t.Fatal(err)
	}
	var ready []corev1.Pod
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil && realnode.PodReady(&p) {
			ready = append(ready, p)
		}
	}
	if len(ready) == 0 {
		t.Fatalf("no Ready pod in %s matches %v", ns, labels)
	}
	sort.Slice(ready, func(i, j int) bool { return ready[i].Name < ready[j].Name })
	return ready
}

// enginePods are every pair's engine pods.
func (f *faulting) enginePods() []corev1.Pod {
	list := &corev1.PodList{}
	_ = f.n.Client.List(bg, list, client.InNamespace("default"), client.HasLabels{kvv1.LabelRole})
	return list.Items
}

func (f *faulting) agentMetrics(t *testing.T) map[string]float64 {
	t.Helper()
	pods := f.pods(t, "kvhandoff-node", client.MatchingLabels{"app.kubernetes.io/component": "transfer-agent"})
	m, err := f.n.PodMetrics("kvhandoff-node", pods[0].Name, realnode.AgentMetricsPort)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// routerRecord is a router's log line of one request.
type routerRecord struct {
	Time       time.Time `json:"time"`
	Outcome    string    `json:"outcome"`
	Prefill    string    `json:"prefill"`
	Decode     string    `json:"decode"`
	Retries    int       `json:"retries"`
	DurationMS float64   `json:"duration_ms"`
}

// loggedInFlight counts the requests the mode's routers logged as in flight at the
// fault (arrived before its action ended, answered or failed after it began) that match.
func (f *faulting) loggedInFlight(t *testing.T, match func(routerRecord) bool) int {
	t.Helper()
	n := 0
	for _, p := range f.pods(t, "default", client.MatchingLabels{kvv1.LabelRouter: f.mode + "-decode"}) {
		sc := bufio.NewScanner(strings.NewReader(logs(t, f.cs, "default", p.Name)))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var r routerRecord
			if json.Unmarshal(sc.Bytes(), &r) != nil || r.Time.IsZero() || r.Outcome == "" {
				continue
			}
			start := r.Time.Add(-time.Duration(r.DurationMS * float64(time.Millisecond)))
			if !start.After(f.after) && !r.Time.Before(f.at) && match(r) {
				n++
			}
		}
	}
	return n
}

// served counts the requests answered whole.
func served(rs []realnode.Result) int {
	n := 0
	for _, r := range rs {
		if !r.Failed() {
			n++
		}
	}
	return n
}

// count counts the requests that arrived in [from, to), answered whole and failed.
func count(rs []realnode.Result, from, to time.Time) (ok, failed int) {
	for _, r := range rs {
		if r.At.Before(from) || !r.At.Before(to) {
			continue
		}
		if r.Failed() {
			failed++
		} else {
			ok++
		}
	}
	return ok, failed
}

func arrivedOK(rs []realnode.Result, from, to time.Time) int {
	ok, _ := count(rs, from, to)
	return ok
}

// named says whether a failed request says why: an error status with the router's or
// the engine's message, or a stream ended by the router's error event.
func named(r realnode.Result) bool {
	return strings.Contains(r.Err, `"message"`)
}

// reason is a failure's cause in a few words, for the report.
func reason(r realnode.Result) string {
	var e struct {
		Error struct{ Message string } `json:"error"`
	}
	msg := r.Err
	if json.Unmarshal([]byte(r.Err), &e) == nil && e.Error.Message != "" {
		msg = e.Error.Message
	}
	// The engine's name and numbers vary; the words after it say what happened.
	if i := strings.Index(msg, ": "); i >= 0 && strings.Contains(msg[:i], "engine") {
		msg = msg[i+2:]
	}
	msg = engineURL.ReplaceAllString(msg, "http://<engine>")
	if len(msg) > 60 {
		msg = msg[:60]
	}
	return fmt.Sprintf("%d %s", r.Status, msg)
}

var engineURL = regexp.MustCompile(`https?://[0-9.]+:[0-9]+`)

func hasPrefix(ss []string, prefix string) bool {
	for _, s := range ss {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}

// report logs the table and, with KVHANDOFF_CHAOS_REPORT, writes it there.
func report(t *testing.T, rows []chaosRow) {
	var md strings.Builder
	md.WriteString("| mode | fault | requests | in flight on the part | failed | of them arriving while no pair could serve | failures | slowest in flight at the fault (s) | replacement serving (s) | pre-fault rate back (s) | leaks gone (s) | conditions False during the fault |\n")
	md.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		var reasons []string
		for k, v := range r.Reasons {
			reasons = append(reasons, fmt.Sprintf("%d× %s", v, k))
		}
		sort.Strings(reasons)
		fmt.Fprintf(&md, "| %s | %s | %d | %d | %d | %d | %s | %.1f | %.1f | %.1f | %.1f | %s |\n", r.Mode, r.Fault, r.Requests, r.InFlight, r.Failed, r.FailedInOutage,
			strings.Join(reasons, "; "), r.SlowestSeconds, r.BackSeconds, r.RecoverySeconds, r.LeaksGoneSeconds, strings.Join(r.Conditions, ", "))
	}
	t.Log("\n" + md.String())
	dir := os.Getenv("KVHANDOFF_CHAOS_REPORT")
	if dir == "" {
		return
	}
	js, _ := json.MarshalIndent(rows, "", "  ")
	for name, b := range map[string][]byte{"report.md": []byte(md.String()), "report.json": js} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Error(err)
		}
	}
}
