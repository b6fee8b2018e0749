"""The rollout side of the loop: the rollout pool (slots, the staleness rule, the readiness-aware
buffer, elastic capacity, retries, the ledger), simulated tool latency, and the local and Ray
backends (docs/architecture.md, "System")."""
