"""Whole experiments: train_and_evaluate(config, workdir) and sweeps of configs."""
