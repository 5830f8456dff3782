// Command pause is the real-node tier's pod sandbox ("pause") image: it holds a pod's
// namespaces and does nothing until it is told to stop. No registry is reachable here,
// so the kubelet's default sandbox image is built too.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	// As the kubelet's pause: reap children (a pod sharing its process namespace) while waiting.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGCHLD)
	<-stop
}
