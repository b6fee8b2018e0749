"""Training: batching, forward passes, optimizer steps, the critic, checkpoints."""
