"""An OpenAI-compatible server in front of any tiderl engine, with recorded sessions that train
like built-in episodes (docs/serve.md).

- `wire.py`: the chat-completions wire format (requests, replies with tool calls, stream chunks);
- `session.py`: sessions recorded as exact token ids, prefix reuse, conversion to `Trajectory`;
- `server.py`: `ChatService`, the FastAPI app, `BackgroundServer`, `tiderl serve`;
- `agent.py`: the `agent` rollout backend: an external agent's sessions as the pool's episodes.

Needs the `serve` extra (FastAPI, uvicorn): `pip install tiderl[serve]`.
"""
