"""Training: state, step, losses, optimizer, devices, checkpoints, logs."""
