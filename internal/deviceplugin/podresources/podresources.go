// Package podresources reads which devices the kubelet has given which pods, from its
// PodResources API (the socket every kubelet serves under /var/lib/kubelet/pod-resources),
// so the plugin never advertises a device another resource already holds.
package podresources

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/server"
)

// DefaultSocket is where the kubelet serves the API.
const DefaultSocket = "/var/lib/kubelet/pod-resources/kubelet.sock"

// List returns every device allocation of every pod the kubelet runs.
func List(ctx context.Context, socket string) ([]server.Allocation, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := podresourcesv1.NewPodResourcesListerClient(conn).List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("the kubelet's PodResources API at %s: %w", socket, err)
	}
	var out []server.Allocation
	for _, p := range resp.PodResources {
		for _, c := range p.Containers {
			for _, d := range c.Devices {
				for _, id := range d.DeviceIds {
					out = append(out, server.Allocation{Resource: d.ResourceName, DeviceID: id, Pod: p.Namespace + "/" + p.Name})
				}
			}
			// Devices a DRA driver's claims gave the pod.
			for _, d := range c.DynamicResources {
				for _, r := range d.ClaimResources {
					out = append(out, server.Allocation{Resource: server.DRAResource(r.DriverName), DeviceID: r.DeviceName, Pod: p.Namespace + "/" + p.Name})
				}
			}
		}
	}
	return out, nil
}
