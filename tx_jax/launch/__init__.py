"""Many runs: sweeps of configs, run on this host or queued over TPU VMs (above runner/)."""
