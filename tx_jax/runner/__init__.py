"""One run: train_and_evaluate(config, workdir), its set-up, evaluation, signals and budget."""
