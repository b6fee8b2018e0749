"""Algorithms as pure tensor functions: advantage estimators, losses, aggregation, regularisers.

The trainer (`tiderl.train.step.train_step`) calls these with typed tensors and knows nothing
about which algorithm runs: `registry.py` maps the configured names (`algo.advantage`,
`algo.policy_loss`) to functions, and presets choose the names and their hyperparameters
(`presets.py`). docs/algorithms.md has every formula and its paper. Nothing here imports the
trainer, the config loader or the system.

Import from the modules themselves (`tiderl.algos.advantages`, `.losses`, `.registry`, ...):
the package imports nothing, so the config loader reads `presets` and `registry` without torch.
"""
