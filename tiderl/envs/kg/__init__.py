"""Knowledge-graph environment: backends (in-memory, RDF files, SPARQL), AgentBench-style tools,
the env, task sources (synthetic, MetaQA, AgentBench KG) and oracles. See docs/env_kg.md.

Import from the modules themselves; the package imports nothing, so importing one part
does not load the others.
"""
