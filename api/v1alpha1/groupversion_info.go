// Package v1alpha1 holds the kvhandoff.io/v1alpha1 API: PrefillPool, DecodePool and
// KVTransferPolicy.
//
// +kubebuilder:object:generate=true
// +groupName=kvhandoff.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// The package depends on apimachinery alone, so routers and other programs can import the
// API without controller-runtime.
var (
	// GroupVersion is the group and version of every kind in this package.
	GroupVersion = schema.GroupVersion{Group: "kvhandoff.io", Version: "v1alpha1"}

	// SchemeBuilder registers the kinds of this package with a runtime.Scheme.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)

	// AddToScheme adds the kinds of this package to a runtime.Scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion,
		&KVTransferPolicy{}, &KVTransferPolicyList{},
		&PrefillPool{}, &PrefillPoolList{},
		&DecodePool{}, &DecodePoolList{},
	)
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
