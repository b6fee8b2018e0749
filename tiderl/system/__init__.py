"""Scheduling rollout and training: the asynchronous scheduler, the staleness rule, the
readiness-aware buffer, elastic capacity, simulated latency, and the local and Ray backends
(docs/architecture.md, "System")."""
