package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/gateway"
)

// InstallGatewayCRDs installs the Gateway API Inference Extension's InferencePool CRD.
func (n *Node) InstallGatewayCRDs() error { return envtest.InstallGatewayCRDs(n.api) }

// StartGateway runs Envoy (the envoy image, a static configuration as GIE's and llm-d's
// end-to-end tests use) in front of a mode's DecodePool with gateway.inferencePool: its
// ext_proc is the pool's endpoint picker Service, FailClose. It returns the name of the
// Service in front of Envoy once a completion for model through it is answered.
func (n *Node) StartGateway(ctx context.Context, mode, model string, limit time.Duration) (string, error) {
	name := mode + "-gateway"
	epp := &corev1.Service{}
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, limit, true, func(ctx context.Context) (bool, error) {
		dep := &appsv1.Deployment{}
		if n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: mode + "-decode-epp"}, dep) != nil || dep.Status.AvailableReplicas == 0 {
			return false, nil
		}
		return n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: mode + "-decode-epp"}, epp) == nil, nil
	})
	if err != nil {
		return "", fmt.Errorf("%s: the endpoint picker is not available: %w", mode, err)
	}
	cfg, err := gateway.EnvoyConfig(gateway.EnvoyParams{Admin: 19000, Listen: 8081, ListenAddress: "0.0.0.0", EPP: 9002, EPPAddress: epp.Spec.ClusterIP})
	if err != nil {
		return "", err
	}
	labels := map[string]string{"app": name}
	for _, o := range []client.Object{
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Data: map[string]string{"envoy.yaml": cfg}},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: labels}, Spec: corev1.PodSpec{
			Containers: []corev1.Container{{
				Name: "envoy", Image: Registry + "/envoy:" + Tag, ImagePullPolicy: corev1.PullNever,
				Args:           []string{"-c", "/etc/envoy/envoy.yaml", "--disable-hot-restart", "--concurrency", "2", "-l", "warning"},
				Ports:          []corev1.ContainerPort{{Name: "http", ContainerPort: 8081}},
				ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8081)}}, PeriodSeconds: 1},
				VolumeMounts:   []corev1.VolumeMount{{Name: "config", MountPath: "/etc/envoy", ReadOnly: true}},
			}},
			Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
				LocalObjectReference: corev1.LocalObjectReference{Name: name}}}}},
		}},
		&corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Spec: corev1.ServiceSpec{
			Selector: labels, Ports: []corev1.ServicePort{{Name: "http", Port: 8081, TargetPort: intstr.FromString("http")}}}},
	} {
		if err := n.Client.Create(ctx, o); err != nil {
			return "", fmt.Errorf("creating %T %s: %w", o, name, err)
		}
	}
	url, err := n.ServiceURL(name, "/v1/completions")
	if err != nil {
		return "", err
	}
	req, _ := json.Marshal(map[string]any{"model": model, "prompt": "ready?", "max_tokens": 1})
	var last string
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, limit, true, func(ctx context.Context) (bool, error) {
		resp, err := n.HTTPClient(url, 30*time.Second).Post(url, "application/json", bytes.NewReader(req))
		if err != nil {
			last = err.Error()
			return false, nil
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		last = resp.Status + " " + string(b)
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		return "", fmt.Errorf("%s: envoy did not answer within %s: %w; last %s", mode, limit, err, last)
	}
	return name, nil
}
