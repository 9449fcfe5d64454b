"""Training: the loop (train_one_epoch, evaluate, fit), optimisers and schedules, checkpoints,
metrics, and the engine's single training step (used by `cnnkit bench train`)."""
