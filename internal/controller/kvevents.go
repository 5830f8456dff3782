package controller

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;create
// Secrets: get and create only, never list, watch or update. The manager reads no
// Secret but those it creates, one at a time, and changes none once made.

// kvEventsTokens remembers the PrefillPools (by UID) whose kv-events token Secret this
// manager has seen or made, so a reconcile reads the API for it once, not every time.
type kvEventsTokens struct {
	mu   sync.Mutex
	seen map[types.UID]bool
}

// ensureKVEventsToken makes prefill's kv-events token Secret (render.KVEventsSecret)
// unless it exists: 32 random bytes, immutable, owned by the PrefillPool so it goes with
// it. Routers and pickers of the DecodePools pairing with it, and the sidecars of both
// pools' engines, mount it.
func (r *PoolReconciler) ensureKVEventsToken(ctx context.Context, prefill *kvv1.PrefillPool) error {
	r.kvTokens.mu.Lock()
	defer r.kvTokens.mu.Unlock()
	if r.kvTokens.seen == nil {
		r.kvTokens.seen = map[types.UID]bool{}
	}
	if r.kvTokens.seen[prefill.UID] {
		return nil
	}
	key := types.NamespacedName{Namespace: prefill.Namespace, Name: render.KVEventsSecret(prefill.Name)}
	reader := r.APIReader
	if reader == nil {
		reader = r.Client
	}
	err := reader.Get(ctx, key, &corev1.Secret{})
	if apierrors.IsNotFound(err) {
		err = r.Create(ctx, kvEventsTokenSecret(key, prefill))
		if apierrors.IsAlreadyExists(err) { // the other pool's reconcile made it first
			err = nil
		}
	}
	if err != nil {
		return fmt.Errorf("kv-events token Secret %s: %w", key.Name, err)
	}
	r.kvTokens.seen[prefill.UID] = true
	return nil
}

func kvEventsTokenSecret(key types.NamespacedName, prefill *kvv1.PrefillPool) *corev1.Secret {
	token := make([]byte, 32)
	_, _ = rand.Read(token) // crypto/rand never fails on Linux
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: key.Name, Namespace: key.Namespace,
			Labels: map[string]string{render.LabelManagedBy: render.ManagedBy, kvv1.LabelPool: prefill.Name},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: kvv1.GroupVersion.String(), Kind: "PrefillPool", Name: prefill.Name, UID: prefill.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}},
		Immutable: ptr.To(true),
		Type:      corev1.SecretTypeOpaque,
		Data:      map[string][]byte{render.KVEventsTokenKey: []byte(hex.EncodeToString(token))},
	}
}

// kvEventsSecret is the token Secret the routers and pickers of a DecodePool mount: its
// PrefillPool's, when its policy's routing follows KV events; "" otherwise.
func kvEventsSecret(d *kvv1.DecodePool, policy *kvv1.KVTransferPolicySpec) string {
	if !policy.Routing.KVEvents() {
		return ""
	}
	return render.KVEventsSecret(d.Spec.PrefillPoolRef.Name)
}
