package informer_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/go-logr/logr/testr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/kvhandoff/kvhandoff/internal/informer"
	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

// outage is how long the API server is away: long enough that client-go's own back-off
// (0.8 s doubling to 30 s, each wait stretched by up to as much again) has its next try
// seconds after the return, as it has after the realnode suite's 30 s outage.
const outage = 22 * time.Second

// A cache whose informers come from New sees a change made while the API server was away
// within seconds of its return (its list and watch try again every second); client-go's
// own informers, beside it through the same outage, are logged for comparison. The
// outage is a TCP proxy in front of a real kube-apiserver that stops listening and
// drops every connection through it, as a killed API server does.
func TestACacheSeesWhatChangedDuringAnOutageSoonAfterIt(t *testing.T) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	env, err := envtest.Start(s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	upstream, err := url.Parse(env.Config.Host)
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{t: t, addr: net.JoinHostPort(loopback.New(t), "6443"), upstream: upstream.Host, conns: map[net.Conn]bool{}}
	p.up()
	t.Cleanup(p.down)
	cfg := rest.CopyConfig(env.Config)
	cfg.Host = "https://" + p.addr
	cfg.ServerName = "localhost" // the API server's certificate names localhost and its own address

	// The caches' goroutines may log after the test ends, which a testing.T refuses.
	stderr := funcr.New(func(prefix, args string) { fmt.Fprintln(os.Stderr, prefix, args) }, funcr.Options{})
	log.SetLogger(stderr)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ours := startCache(ctx, t, cfg, cache.Options{Scheme: s, NewInformer: informer.New(stderr)})
	stock := startCache(ctx, t, cfg, cache.Options{Scheme: s})

	p.down()
	time.Sleep(outage) // the fault's length, not a wait for anything
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "made-while-away"}}
	if err := env.Client.Create(ctx, cm); err != nil {
		t.Fatal(err)
	}
	p.up()
	back := time.Now()

	seen := func(c cache.Cache) bool {
		return c.Get(ctx, client.ObjectKeyFromObject(cm), &corev1.ConfigMap{}) == nil
	}
	const within = 5 * time.Second // Retry, its jitter, one list: a second or two
	if !waitFor(back.Add(time.Minute), func() bool { return seen(ours) }) {
		t.Fatal("the cache never saw the ConfigMap made during the outage")
	}
	lag := time.Since(back)
	t.Logf("after a %s outage: seen %.1f s after the API server was back", outage, lag.Seconds())
	if lag > within {
		t.Errorf("the cache saw the ConfigMap made during the outage %.1f s after the API server was back, over %s", lag.Seconds(), within)
	}
	if waitFor(back.Add(2*within), func() bool { return seen(stock) }) {
		t.Logf("client-go's own informer: seen %.1f s after", time.Since(back).Seconds())
	} else {
		t.Logf("client-go's own informer: not seen %s after", 2*within)
	}
}

// Only the API server's absence is retried: an error it answers with is the reflector's
// to handle (a 410 makes it list again, a 429 backs off), and the context ends the tries.
func TestOnlyARefusedOrResetConnectionIsTriedAgain(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	gone := apierrors.NewResourceExpired("too old resource version")
	busy := apierrors.NewTooManyRequests("slow down", 1)
	for _, c := range []struct {
		name  string
		errs  []error
		calls int
		want  error
	}{
		{"refused twice, then listed", []error{refused, refused, nil}, 3, nil},
		{"reset, then listed", []error{reset, nil}, 2, nil},
		{"410 returned at once", []error{gone}, 1, gone},
		{"429 returned at once", []error{busy}, 1, busy},
		{"refused, then 410", []error{refused, gone}, 2, gone},
	} {
		t.Run(c.name, func(t *testing.T) {
			lw := &scripted{errs: c.errs}
			r := informer.Retrying(lw, testr.New(t), time.Millisecond).(toolscache.ListerWatcherWithContext)
			for _, call := range []func() error{
				func() error { _, err := r.ListWithContext(context.Background(), metav1.ListOptions{}); return err },
				func() error { _, err := r.WatchWithContext(context.Background(), metav1.ListOptions{}); return err },
			} {
				lw.calls = 0
				if err := call(); !errors.Is(err, c.want) {
					t.Errorf("got %v, want %v", err, c.want)
				}
				if lw.calls != c.calls {
					t.Errorf("%d calls, want %d", lw.calls, c.calls)
				}
			}
		})
	}
	t.Run("the context ends the tries", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		lw := &scripted{errs: []error{refused}, onCall: func(n int) {
			if n == 3 {
				cancel()
			}
		}}
		r := informer.Retrying(lw, testr.New(t), time.Millisecond).(toolscache.ListerWatcherWithContext)
		if _, err := r.ListWithContext(ctx, metav1.ListOptions{}); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("got %v, want the refusal", err)
		}
		if lw.calls != 3 {
			t.Errorf("%d calls, want 3: none after the context ended", lw.calls)
		}
	})
}

// scripted answers each call with its next error (the last one over and over); nil is a
// success.
type scripted struct {
	errs   []error
	calls  int
	onCall func(n int)
}

func (s *scripted) next() error {
	s.calls++
	if s.onCall != nil {
		s.onCall(s.calls)
	}
	return s.errs[min(s.calls, len(s.errs))-1]
}

func (s *scripted) List(metav1.ListOptions) (runtime.Object, error) {
	if err := s.next(); err != nil {
		return nil, err
	}
	return &corev1.ConfigMapList{}, nil
}

func (s *scripted) Watch(metav1.ListOptions) (watch.Interface, error) {
	if err := s.next(); err != nil {
		return nil, err
	}
	return watch.NewEmptyWatch(), nil
}

func startCache(ctx context.Context, t *testing.T, cfg *rest.Config, o cache.Options) cache.Cache {
	t.Helper()
	c, err := cache.New(cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetInformerForKind(ctx, schema.GroupVersionKind{Version: "v1", Kind: "ConfigMap"}); err != nil {
		t.Fatal(err)
	}
	go func() { _ = c.Start(ctx) }()
	if !c.WaitForCacheSync(ctx) {
		t.Fatal("the cache did not sync")
	}
	return c
}

// waitFor polls ok until it holds or deadline passes.
func waitFor(deadline time.Time, ok func() bool) bool {
	for !ok() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// proxy forwards TCP connections from addr to upstream; down stops listening and drops
// every connection through it, up listens again.
type proxy struct {
	t              *testing.T
	addr, upstream string
	mu             sync.Mutex
	ln             net.Listener
	conns          map[net.Conn]bool
}

func (p *proxy) up() {
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Fatal(err)
	}
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.forward(c)
		}
	}()
}

func (p *proxy) forward(c net.Conn) {
	u, err := net.Dial("tcp", p.upstream)
	if err != nil {
		_ = c.Close()
		return
	}
	if !p.track(c, u) {
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(to, from net.Conn) {
		_, _ = io.Copy(to, from)
		done <- struct{}{}
	}
	go pipe(u, c)
	go pipe(c, u)
	<-done
	_ = c.Close()
	_ = u.Close()
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, u)
	p.mu.Unlock()
}

// track records c and u, or closes them if the proxy went down meanwhile.
func (p *proxy) track(c, u net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		_ = c.Close()
		_ = u.Close()
		return false
	}
	p.conns[c], p.conns[u] = true, true
	return true
}

func (p *proxy) down() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		_ = c.Close()
	}
	clear(p.conns)
}
