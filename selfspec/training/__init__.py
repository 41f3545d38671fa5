"""Training: the one `fit` loop, its checkpoints, objectives, losses and data."""
