package server

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// Config is what Serve serves.
type Config struct {
	// PluginDir is the kubelet's device-plugin folder (/var/lib/kubelet/device-plugins),
	// holding kubelet.sock and the plugins' sockets.
	PluginDir string
	Resources []Resource
	State     *State
	Log       *slog.Logger
}

// Serve runs one plugin per resource until ctx ends: it starts each plugin's server,
// registers it with the kubelet, and does both again whenever the kubelet restarts (it
// removes every plugin socket and creates kubelet.sock anew) or a plugin socket vanishes.
// On return every plugin socket is removed.
func Serve(ctx context.Context, cfg Config) error {
	log := cfg.Log
	if log == nil {
		log = slog.Default()
	}
	kubelet := filepath.Join(cfg.PluginDir, filepath.Base(pluginapi.KubeletSocket))
	plugins := make([]*plugin, len(cfg.Resources))
	for i, r := range cfg.Resources {
		plugins[i] = &plugin{res: r, socket: filepath.Join(cfg.PluginDir, socketName(r.Name)), state: cfg.State}
	}
	defer func() {
		for _, p := range plugins {
			p.stop()
		}
	}()

	watcher, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer watcher.Close()
	if err := watcher.Add(cfg.PluginDir); err != nil {
		return err
	}

	registered := false
	restart := func() {
		registered = true
		for _, p := range plugins {
			p.stop()
			if err := p.start(); err != nil {
				log.Error("starting plugin", "resource", p.res.Name, "err", err)
				registered = false
				continue
			}
			if err := p.register(ctx, kubelet); err != nil {
				log.Warn("kubelet registration failed; retrying", "resource", p.res.Name, "err", err)
				registered = false
				continue
			}
			log.Info("registered with the kubelet", "resource", p.res.Name, "socket", p.socket)
		}
	}
	if _, err := os.Stat(kubelet); err == nil {
		restart()
	}
	retry := time.NewTicker(5 * time.Second)
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-watcher.Events:
			if !ok {
				return errors.New("plugin folder watch closed")
			}
			switch {
			case ev.Name == kubelet && ev.Has(fsnotify.Create):
				log.Info("kubelet socket created; the kubelet restarted, registering again")
				restart()
			case ev.Has(fsnotify.Remove) && isPluginSocket(plugins, ev.Name):
				log.Info("plugin socket removed; serving and registering again", "socket", ev.Name)
				restart()
			}
		case err := <-watcher.Errors:
			log.Warn("watching the plugin folder", "err", err)
		case <-retry.C:
			if !registered {
				if _, err := os.Stat(kubelet); err == nil {
					restart()
				}
			}
		}
	}
}

func isPluginSocket(ps []*plugin, name string) bool {
	for _, p := range ps {
		if p.socket == name && p.server != nil {
			return true
		}
	}
	return false
}
