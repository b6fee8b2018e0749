"""The repository-editing environment: fix a small Python package so its tests pass."""
