package realnode

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// LoadFollowingEngines are the simulated engines with a speed that follows their load,
// as engineArgs of both pools: a prefill takes 1 s per 1000 prompt tokens, one at a time
// (so TTFT grows with the prompt tokens in flight), and the gap between output tokens is
// 10 ms plus 4 ms per stream the engine generates for. Their KV caches are small (512
// blocks of 16 tokens): prompts stay short, so that a push decode engine's registrations
// for prompts queued at prefill do not fill it.
var LoadFollowingEngines = func() Engines {
	e := SimEngines
	e.Args = []string{"--sim-prefill-per-1k-tokens=1s", "--sim-tpot=10ms", "--sim-tpot-per-stream=4ms"}
	return e
}()

// The autoscaling that the stepped-load test, its report and the demo give a pair of
// LoadFollowingEngines: CPU engines count one each against the budget; windows short
// enough for a test.
const (
	TargetTTFT = 1500 * time.Millisecond
	TargetITL  = 30 * time.Millisecond
	Budget     = 4
)

// Autoscaled sets a DecodePool's autoscaling to those targets: 1–3 engines a role.
func Autoscaled(d *kvv1.DecodePool) {
	d.Spec.Autoscaling = &kvv1.AutoscalingSpec{
		TTFT: kvv1.LatencyTarget{Milliseconds: int32(TargetTTFT.Milliseconds())}, ITL: kvv1.LatencyTarget{Milliseconds: int32(TargetITL.Milliseconds())},
		Prefill: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 3}, Decode: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 3},
		AcceleratorBudget: Budget, WindowSeconds: 6, WarmupSeconds: ptr.To[int32](3), StabilizationWindowSeconds: ptr.To[int32](10),
	}
}

// AutoscaleInterval is the chart value that makes the manager decide every second.
const AutoscaleInterval = `manager.autoscaleInterval="1s"`

// The stepped load's phases: prompts that keep prefill busy (6 a second of 200 words,
// 0.2 s of prefill each, short answers), answers that keep decode busy (2 a second of 100
// tokens), and a low load between.
var (
	LowLoad      = Phase{Name: "low", Rate: 1, Prompt: 100, Answer: 20}
	PrefillHeavy = Phase{Name: "prefill-heavy", Rate: 6, Prompt: 200, Answer: 8}
	DecodeHeavy  = Phase{Name: "decode-heavy", Rate: 2, Prompt: 100, Answer: 100}
)

// Phase is a stretch of a stepped load: requests arrive Rate a second, each a streamed
// chat request with a prompt of Prompt words and an answer of Answer tokens.
type Phase struct {
	Name           string
	Rate           float64
	Prompt, Answer int
}

// Load sends a stepped load through a mode's router Service (or a gateway) and records every request
// as its client saw it, and the pair's engine pods every 100 ms.
type Load struct {
	n    *Node
	mode string
	url  string
	done chan struct{}
	wg   sync.WaitGroup

	mu      sync.Mutex
	current Phase
	arrived []time.Time
	results []Result
	samples []Sample
}

// Result is one request as its client saw it.
type Result struct {
	Phase  string
	At     time.Time
	End    time.Time // when the answer ended, or the request failed
	Status int
	Err    string
	TTFT   time.Duration
	Gaps   []time.Duration
}

// Failed reports whether the request failed, by status or by a broken stream.
func (r Result) Failed() bool { return r.Status != http.StatusOK || r.Err != "" }

// Sample is the pair every 100 ms: its engine pods, terminating ones included, and the
// autoscaler's sizes.
type Sample struct {
	At                      time.Time
	PrefillPods, DecodePods int
	Prefill, Decode         int32
}

// StartLoad starts sending phase p through mode's router Service.
func (n *Node) StartLoad(mode string, p Phase) (*Load, error) {
	return n.StartLoadVia(mode+"-decode-router", mode, p)
}

// StartLoadVia is StartLoad through Service service (a gateway in front of the mode's
// DecodePool).
func (n *Node) StartLoadVia(service, mode string, p Phase) (*Load, error) {
	url, err := n.ServiceURL(service, "/v1/chat/completions")
	if err != nil {
		return nil, err
	}
	l := &Load{n: n, mode: mode, url: url, done: make(chan struct{}), current: p}
	l.wg.Go(l.sample)
	l.wg.Go(l.arrive)
	return l, nil
}

// Phase switches the load to p.
func (l *Load) Phase(p Phase) {
	l.mu.Lock()
	l.current = p
	l.mu.Unlock()
}

// Stop stops sending and waits for every request's answer.
func (l *Load) Stop() {
	select {
	case <-l.done:
	default:
		close(l.done)
	}
	l.wg.Wait()
}

// arrive sends the current phase's requests at its rate, each on its own, until stopped.
func (l *Load) arrive() {
	next := time.Now()
	for i := 0; ; i++ {
		l.mu.Lock()
		p := l.current
		l.mu.Unlock()
		next = next.Add(time.Duration(float64(time.Second) / p.Rate))
		select {
		case <-l.done:
			return
		case <-time.After(time.Until(next)):
		}
		l.wg.Go(func() { l.send(p, i) })
	}
}

func (l *Load) send(p Phase, i int) {
	words := make([]string, p.Prompt)
	for w := range words {
		words[w] = fmt.Sprintf("w%d", (i*7+w)%997)
	}
	body, _ := json.Marshal(map[string]any{"model": SimEngines.Model, "max_tokens": p.Answer, "stream": true,
		"messages": []map[string]string{{"role": "user", "content": strings.Join(words, " ")}}})
	res := Result{Phase: p.Name, At: time.Now()}
	l.mu.Lock()
	l.arrived = append(l.arrived, res.At)
	l.mu.Unlock()
	defer func() {
		res.End = time.Now()
		l.mu.Lock()
		l.results = append(l.results, res)
		l.mu.Unlock()
	}()
	resp, err := l.n.HTTPClient(l.url, 2*time.Minute).Post(l.url, "application/json", bytes.NewReader(body))
	if err != nil {
		res.Err = err.Error()
		return
	}
	defer resp.Body.Close()
	res.Status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		res.Err = string(b)
		return
	}
	sc := bufio.NewScanner(resp.Body)
	last, done := time.Time{}, false
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		now := time.Now()
		if line == "data: [DONE]" {
			done = true
			break
		}
		if strings.HasPrefix(line, `data: {"error"`) {
			res.Err = strings.TrimPrefix(line, "data: ") // the router's reason for a stream that broke
			return
		}
		if last.IsZero() {
			res.TTFT = now.Sub(res.At)
		} else {
			res.Gaps = append(res.Gaps, now.Sub(last))
		}
		last = now
	}
	if !done {
		res.Err = fmt.Sprintf("the stream ended without [DONE] (%v)", sc.Err())
	}
}

// sample counts the pair's engine pods and reads the autoscaler's sizes every 100 ms.
func (l *Load) sample() {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-l.done:
			return
		case <-tick.C:
		}
		s := Sample{At: time.Now()}
		s.PrefillPods, _ = l.n.Pods(l.mode+"-prefill", kvv1.RolePrefill)
		s.DecodePods, _ = l.n.Pods(l.mode+"-decode", kvv1.RoleDecode)
		d := &kvv1.DecodePool{}
		if err := l.n.Client.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: l.mode + "-decode"}, d); err == nil && d.Status.Autoscaling != nil {
			s.Prefill, s.Decode = d.Status.Autoscaling.PrefillReplicas, d.Status.Autoscaling.DecodeReplicas
		}
		l.mu.Lock()
		l.samples = append(l.samples, s)
		l.mu.Unlock()
	}
}

// Pods counts a pool's engine pods, terminating ones included, and how many are Ready
// and not terminating.
func (n *Node) Pods(pool string, role kvv1.Role) (all, ready int) {
	pods := &corev1.PodList{}
	if err := n.Client.List(context.Background(), pods, client.InNamespace("default"), client.MatchingLabels{kvv1.LabelPool: pool, kvv1.LabelRole: string(role)}); err != nil {
		return -1, -1
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && PodReady(&p) {
			ready++
		}
	}
	return len(pods.Items), ready
}

// Measure lets the load run for d and returns the p90 TTFT and token gap of the requests
// that arrived meanwhile, once they all have been answered.
func (l *Load) Measure(d time.Duration) (ttft, itl time.Duration) {
	from := time.Now()
	time.Sleep(d) // the load runs meanwhile: this is the stretch measured
	to := time.Now()
	in := func(at time.Time) bool { return !at.Before(from) && at.Before(to) }
	for {
		l.mu.Lock()
		arrived := 0
		for _, at := range l.arrived {
			if in(at) {
				arrived++
			}
		}
		var ttfts, gaps []time.Duration
		for _, r := range l.results {
			if in(r.At) {
				ttfts = append(ttfts, r.TTFT)
				gaps = append(gaps, r.Gaps...)
			}
		}
		l.mu.Unlock()
		if len(ttfts) == arrived {
			return P90(ttfts), P90(gaps)
		}
		time.Sleep(100 * time.Millisecond) // until the stretch's last answers are in
	}
}

// Results and Samples are what the load recorded so far.
func (l *Load) Results() []Result {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.results)
}

func (l *Load) Samples() []Sample {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.samples)
}

// P90 is the 90th percentile of ds (0 for none).
func P90(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	ds = slices.Clone(ds)
	slices.Sort(ds)
	return ds[(len(ds)*9)/10]
}

// WaitFor polls cond every 250 ms until it holds, for at most limit.
func WaitFor(ctx context.Context, what string, limit time.Duration, cond func() bool) error {
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, limit, true, func(context.Context) (bool, error) { return cond(), nil })
	if err != nil {
		return fmt.Errorf("waiting %s for %s: %w", limit, what, err)
	}
	return nil
}
