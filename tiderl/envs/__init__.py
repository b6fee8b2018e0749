"""Environments: one protocol, each environment owns its tools and reward."""
