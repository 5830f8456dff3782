package controller

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

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

// kvEventsTokens remembers when this manager last saw (or made) each PrefillPool's
// kv-events token Secret, by the pool's UID, so a reconcile reads the API for it once a
// recheck, not every time.
type kvEventsTokens struct {
	mu      sync.Mutex
	seen    map[types.UID]time.Time
	recheck time.Duration
}

// ensureKVEventsToken makes prefill's kv-events token Secret (render.KVEventsSecret)
// unless it exists: 32 random bytes, immutable, owned by the PrefillPool so it goes with
// it. Routers and pickers of the DecodePools pairing with it, and the sidecars of both
// pools' engines, mount it. A Secret of that name that the pool does not control is a
// NameConflict, never used: its author would hold every follower's token. It is looked
// for again after kvTokens.recheck (the PrefillPool's reconcile comes back then), so a
// deleted Secret is made again.
func (r *PoolReconciler) ensureKVEventsToken(ctx context.Context, prefill *kvv1.PrefillPool) error {
	r.kvTokens.mu.Lock()
	defer r.kvTokens.mu.Unlock()
	if r.kvTokens.seen == nil {
		r.kvTokens.seen = map[types.UID]time.Time{}
	}
	if at, ok := r.kvTokens.seen[prefill.UID]; ok && time.Since(at) < r.kvTokens.recheck {
		return nil
	}
	key := types.NamespacedName{Namespace: prefill.Namespace, Name: render.KVEventsSecret(prefill.Name)}
	reader := r.APIReader
	if reader == nil {
		reader = r.Client
	}
	live := &corev1.Secret{}
	err := reader.Get(ctx, key, live)
	switch {
	case apierrors.IsNotFound(err):
		err = r.Create(ctx, kvEventsTokenSecret(key, prefill))
		if apierrors.IsAlreadyExists(err) { // the other pool's reconcile made it first
			err = nil
		}
	case err == nil:
		if ref := metav1.GetControllerOf(live); ref == nil || ref.UID != prefill.UID {
			return &problem{Reason: kvv1.ReasonNameConflict, Message: fmt.Sprintf("Secret %s already exists and is not this PrefillPool's "+
				"kv-events token; delete it or rename the pool (its author would hold the token every follower of the engines' KV events presents)", key.Name)}
		}
	}
	if err != nil {
		return fmt.Errorf("kv-events token Secret %s: %w", key.Name, err)
	}
	r.kvTokens.seen[prefill.UID] = time.Now()
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
