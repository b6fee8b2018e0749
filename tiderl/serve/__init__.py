"""An OpenAI-compatible server in front of any tiderl engine, with recorded sessions that train
like built-in episodes (docs/serve.md; the modules: docs/architecture.md). Needs the `serve` extra
(FastAPI, uvicorn): `pip install tiderl[serve]`.
"""
