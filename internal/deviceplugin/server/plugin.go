package server

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
)

// plugin serves one resource on its own socket in the kubelet's plugin folder.
type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	res    Resource
	socket string
	state  *State

	server *grpc.Server
}

// State is what every plugin serves from: the inventory and device health. Changes are
// broadcast to every ListAndWatch stream.
type State struct {
	mu        sync.Mutex
	inv       inventory.Inventory
	healthy   map[string]bool
	listeners map[chan struct{}]bool
}

// NewState returns a state over an inventory, every device as discovered.
func NewState(inv inventory.Inventory) *State {
	s := &State{inv: inv, healthy: map[string]bool{}, listeners: map[chan struct{}]bool{}}
	for _, d := range inv.Devices {
		s.healthy[d.ID] = d.Healthy
	}
	return s
}

// SetHealth records devices' health and wakes every ListAndWatch when something changed.
func (s *State) SetHealth(health map[string]bool) {
	s.mu.Lock()
	changed := false
	for id, h := range health {
		if s.healthy[id] != h {
			s.healthy[id] = h
			changed = true
		}
	}
	var ls []chan struct{}
	for l := range s.listeners {
		ls = append(ls, l)
	}
	s.mu.Unlock()
	if !changed {
		return
	}
	for _, l := range ls {
		select {
		case l <- struct{}{}:
		default: // a send is already pending; that stream will read the latest state
		}
	}
}

func (s *State) snapshot() (inventory.Inventory, func(inventory.Device) bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := make(map[string]bool, len(s.healthy))
	for k, v := range s.healthy {
		h[k] = v
	}
	return s.inv, func(d inventory.Device) bool { return h[d.ID] }
}

func (s *State) listen() (chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	s.listeners[ch] = true
	s.mu.Unlock()
	return ch, func() {
		s.mu.Lock()
		delete(s.listeners, ch)
		s.mu.Unlock()
	}
}

func socketName(resource string) string {
	return "kvhandoff-" + strings.NewReplacer("/", "-", ".", "-").Replace(resource) + ".sock"
}

func (p *plugin) start() error {
	_ = os.Remove(p.socket)
	l, err := net.Listen("unix", p.socket)
	if err != nil {
		return fmt.Errorf("%s: listening on %s: %w", p.res.Name, p.socket, err)
	}
	p.server = grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(p.server, p)
	go func() { _ = p.server.Serve(l) }()
	return nil
}

func (p *plugin) stop() {
	if p.server != nil {
		p.server.Stop()
		p.server = nil
	}
	_ = os.Remove(p.socket)
}

// register tells the kubelet about the plugin.
func (p *plugin) register(ctx context.Context, kubeletSocket string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(p.socket),
		ResourceName: p.res.Name,
		Options:      &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	})
	if err != nil {
		return fmt.Errorf("registering %s with the kubelet: %w", p.res.Name, err)
	}
	return nil
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	wake, done := p.state.listen()
	defer done()
	for {
		inv, healthy := p.state.snapshot()
		if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.res.devices(inv, healthy)}); err != nil {
			return err
		}
		select {
		case <-wake:
		case <-stream.Context().Done():
			return nil
		}
	}
}

func (p *plugin) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	inv, _ := p.state.snapshot()
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, c := range req.ContainerRequests {
		ids := p.res.preferred(inv, c.AvailableDeviceIDs, c.MustIncludeDeviceIDs, int(c.AllocationSize))
		if ids == nil {
			return nil, fmt.Errorf("%s: cannot pick %d of %d available devices including %v", p.res.Name, c.AllocationSize,
				len(c.AvailableDeviceIDs), c.MustIncludeDeviceIDs)
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	inv, _ := p.state.snapshot()
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		r, err := p.res.allocate(inv, c.DevicesIds)
		if err != nil {
			return nil, err
		}
		resp.ContainerResponses = append(resp.ContainerResponses, r)
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
