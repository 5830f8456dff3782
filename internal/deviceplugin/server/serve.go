package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
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

	// Events are coalesced, then the folder is compared with what was served: the kubelet
	// restarted when kubelet.sock is a new file, and a plugin must be served again when its
	// socket is gone. Our own restarts remove and recreate sockets too; comparing state
	// instead of reacting to each event keeps them from triggering further restarts.
	served := "" // identity of the kubelet.sock registered with; "" when not registered
	reconcile := func() {
		id := fileID(kubelet)
		if id == "" {
			return // no kubelet yet: wait for its socket
		}
		need := id != served
		for _, p := range plugins {
			if _, err := os.Stat(p.socket); err != nil {
				need = true
			}
		}
		if !need {
			return
		}
		if id != served && served != "" {
			log.Info("the kubelet restarted; serving and registering again")
		}
		served = id
		for _, p := range plugins {
			p.stop()
			if err := p.start(); err != nil {
				log.Error("starting plugin", "resource", p.res.Name, "err", err)
				served = ""
				continue
			}
			if err := p.register(ctx, kubelet); err != nil {
				log.Warn("kubelet registration failed; retrying", "resource", p.res.Name, "err", err)
				served = ""
				continue
			}
			log.Info("registered with the kubelet", "resource", p.res.Name, "socket", p.socket)
		}
	}
	reconcile()
	settle := time.NewTimer(time.Hour)
	settle.Stop()
	retry := time.NewTicker(5 * time.Second)
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case _, ok := <-watcher.Events:
			if !ok {
				return errors.New("plugin folder watch closed")
			}
			settle.Reset(100 * time.Millisecond)
		case err := <-watcher.Errors:
			log.Warn("watching the plugin folder", "err", err)
		case <-settle.C:
			reconcile()
		case <-retry.C:
			reconcile()
		}
	}
}

// fileID identifies a file by inode and change time, "" when it does not exist.
func fileID(path string) string {
	fi, err := os.Stat(path)
	if err != nil {
		return ""
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return fmt.Sprintf("%d/%d.%d", st.Ino, st.Ctim.Sec, st.Ctim.Nsec)
	}
	return fi.ModTime().String()
}
