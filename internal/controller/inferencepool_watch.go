package controller

import (
	"sync"

	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/source"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// inferencePoolWatch starts the DecodePool controller's watch on the InferencePools it
// owns at the first one it applies. A watch on a kind the API server does not serve would
// stop the manager, and the Gateway API Inference Extension's CRDs may be installed after
// the manager started; whenever they came, a gateway's report then reaches the pool's
// InferencePoolReady at once. The watch's first list brings every InferencePool that
// changed before it started.
type inferencePoolWatch struct {
	mu      sync.Mutex
	ctrl    controller.Controller
	mgr     manager.Manager
	started bool
}

// start adds the watch once. A nil watch (a reconciler without a controller, in unit
// tests) starts nothing.
func (w *inferencePoolWatch) start() error {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started {
		return nil
	}
	owned := handler.EnqueueRequestForOwner(w.mgr.GetScheme(), w.mgr.GetRESTMapper(), &kvv1.DecodePool{}, handler.OnlyControllerOwner())
	if err := w.ctrl.Watch(source.Kind(w.mgr.GetCache(), client.Object(&infv1.InferencePool{}), owned)); err != nil {
		return err
	}
	w.started = true
	return nil
}
