// Command manager runs kvhandoff's controllers: it turns PrefillPools, DecodePools and
// KVTransferPolicies into wired vLLM engine workloads.
package main

import (
	"flag"
	"os"
	"time"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

func main() {
	var metricsAddr, probeAddr string
	var leaderElect bool
	flag.StringVar(&metricsAddr, "metrics-bind-address", ":8443", "address the Prometheus metrics endpoint binds to; 0 disables it")
	metricsSecure := flag.Bool("metrics-secure", true, "serve metrics over HTTPS to callers the API server authenticates and authorizes for "+
		"/metrics (false: plain HTTP to anyone)")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "address of the /healthz and /readyz endpoints")
	flag.BoolVar(&leaderElect, "leader-elect", false, "elect a leader, so that only one of several manager replicas reconciles")
	var o controller.Options
	images := &o.Images
	flag.StringVar(&images.Router, "router-image", render.DefaultRouterImage, "router image for DecodePools whose spec.router.image is empty: the "+
		"router of this manager's version")
	flag.StringVar(&images.Connector, "connector-image", render.DefaultConnectorImage, "image of the vLLM connector init container for engines of "+
		"a policy with executor Agent: the connector of this manager's version")
	flag.DurationVar(&o.RouterHealthInterval, "router-health-interval", 10*time.Second, "how often every router pod's transfer health "+
		"report is read into its DecodePool's TransferHealthy condition")
	flag.DurationVar(&o.AutoscaleInterval, "autoscale-interval", 15*time.Second, "how often the autoscaler reads the load of DecodePools "+
		"with spec.autoscaling and decides their pairs' sizes")
	opts := zap.Options{}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))
	log := ctrl.Log.WithName("setup")

	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), ctrl.Options{
		Scheme:                 controller.NewScheme(),
		Metrics:                controller.MetricsOptions(metricsAddr, *metricsSecure),
		HealthProbeBindAddress: probeAddr,
		LeaderElection:         leaderElect,
		LeaderElectionID:       "kvhandoff-manager.kvhandoff.io",
		Cache:                  controller.CacheOptions(),
	})
	if err != nil {
		log.Error(err, "creating the manager")
		os.Exit(1)
	}
	if err := controller.Setup(mgr, o); err != nil {
		log.Error(err, "setting up the controllers")
		os.Exit(1)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		log.Error(err, "adding the health check")
		os.Exit(1)
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		log.Error(err, "adding the readiness check")
		os.Exit(1)
	}
	log.Info("starting the manager")
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		log.Error(err, "running the manager")
		os.Exit(1)
	}
}
