package controller

import (
	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// routerImage is the image of a DecodePool's router binary: the pool's, else the
// manager's version's.
func (r *PoolReconciler) routerImage(d *kvv1.DecodePool) string {
	switch {
	case d.Spec.Router.Image != "":
		return d.Spec.Router.Image
	case r.RouterImage != "":
		return r.RouterImage
	}
	return render.DefaultRouterImage
}

// kvEventsImage is the image of a pool's kv-events sidecar: its DecodePool's router
// image, and for a PrefillPool the manager's version's.
func (r *PoolReconciler) kvEventsImage(p pool) string {
	d, ok := p.object().(*kvv1.DecodePool)
	if !ok {
		d = &kvv1.DecodePool{} // names no image of its own
	}
	return r.routerImage(d)
}
