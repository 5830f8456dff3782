package controller

import (
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// pool is what the reconciler needs of a PrefillPool or a DecodePool.
type pool interface {
	// object is the PrefillPool or DecodePool itself, for the client.
	object() client.Object
	GetName() string
	GetNamespace() string
	engine() *kvv1.EngineSpec
	status() *kvv1.PoolStatus
	role() kvv1.Role
	// prefillPoolName is the PrefillPool a DecodePool pairs with; "" for a PrefillPool.
	prefillPoolName() string
}

type prefillPool struct{ *kvv1.PrefillPool }

func (p prefillPool) object() client.Object    { return p.PrefillPool }
func (p prefillPool) engine() *kvv1.EngineSpec { return &p.Spec.EngineSpec }
func (p prefillPool) status() *kvv1.PoolStatus { return &p.Status }
func (p prefillPool) role() kvv1.Role          { return kvv1.RolePrefill }
func (p prefillPool) prefillPoolName() string  { return "" }

type decodePool struct{ *kvv1.DecodePool }

func (d decodePool) object() client.Object    { return d.DecodePool }
func (d decodePool) engine() *kvv1.EngineSpec { return &d.Spec.EngineSpec }
func (d decodePool) status() *kvv1.PoolStatus { return &d.Status }
func (d decodePool) role() kvv1.Role          { return kvv1.RoleDecode }
func (d decodePool) prefillPoolName() string  { return d.Spec.PrefillPoolRef.Name }

// poolOf wraps a PrefillPool or DecodePool.
func poolOf(obj client.Object) pool {
	if d, ok := obj.(*kvv1.DecodePool); ok {
		return decodePool{d}
	}
	return prefillPool{obj.(*kvv1.PrefillPool)}
}

// newPool returns an empty pool of role, ready to be read into.
func newPool(role kvv1.Role) pool {
	if role == kvv1.RoleDecode {
		return decodePool{&kvv1.DecodePool{}}
	}
	return prefillPool{&kvv1.PrefillPool{}}
}
