"""SQL database environment: AgentBench DB-style tools, pluggable backends (SQLite by default,
DuckDB, any SQLAlchemy URL), safe per-episode databases, scoring, tasks and an oracle.

Import from the modules themselves; the package imports nothing, so importing one part
does not load the others.
"""
