"""`tiderl serve`: an OpenAI-compatible chat-completions server in front of any tiderl engine: plain
`/v1/...` routes, and the same under `/sessions/<id>/v1/...` with every request recorded (the
routes: docs/serve.md).

`ChatService` does the work (render with the tokenizer's chat template, sample with the engine
through a `BatchingEngine`, parse tool calls in `model.tool_call_format`, record); `create_app`
puts it behind FastAPI; `BackgroundServer` runs an app on a free port in a thread (tests and
in-process training with an external agent).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tiderl.agent.chat import ChatFormat, TemplateError, chat_format
from tiderl.agent.tool_parser import tool_call_format_of
from tiderl.rollout.base import Engine, SamplingParams
from tiderl.rollout.client import BatchingEngine
from tiderl.serve.images import generate, has_images, takes_images
from tiderl.serve.session import Session, SessionStore, Turn, session_free_turn
from tiderl.serve.wire import (
    ChatRequest,
    RequestError,
    assistant_reply,
    completion_body,
    completion_id,
    content_pieces,
    read_request,
    stream_chunks,
)
from tiderl.train.value_pretrain import save_trajectories

if TYPE_CHECKING:
    from tiderl.config import RunConfig

logger = logging.getLogger(__name__)


class ChatService:
    """Chat completions from `engine` with `tokenizer`'s chat template, recorded per session.

    `max_new_tokens`: the default and the cap of a request's max_tokens; `max_total_tokens`: the
    longest conversation (prompt and reply) in tokens. `temperature`/`top_p`: used when a request
    does not set them, or always with `override_sampling` (training wants the run's behaviour
    distribution whatever the agent asks for). Start it inside the serving event loop.
    """

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str, max_new_tokens: int, max_total_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, override_sampling: bool = False,
                 store: SessionStore | None = None, max_batch_size: int = 64):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_new_tokens, self.max_total_tokens = max_new_tokens, max_total_tokens
        self.temperature, self.top_p, self.override_sampling = temperature, top_p, override_sampling
        self.store = store or SessionStore()
        self.max_batch_size = max_batch_size
        self.client: BatchingEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, where `client` lives

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.client = BatchingEngine(self.engine, self.max_batch_size)
        self.client.start()

    async def update_weights(self, weights: dict[str, Any], version: int) -> Any:
        """Load `weights` as `version` between two decode steps, from any event loop (the serving
        loop runs on its own thread); returns the engine's checksum of what it now holds."""
        if self.client is None or self.loop is None:
            raise RuntimeError("ChatService.start() was not called")
        client = self.client

        async def load() -> Any:
            await client.update_weights(weights, version)
            return await client.call(self.engine.state_checksum)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(load(), self.loop))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    def _format(self, request: ChatRequest) -> ChatFormat:
        try:
            return chat_format(self.tokenizer, request.tools)
        except TemplateError as exc:
            raise RequestError(f"the model's chat template cannot be used with these tools: {exc}", "tools") from None

    def _plan(self, fmt: ChatFormat, request: ChatRequest, session: Session | None) -> Turn:
        try:
            if session is not None:
                return session.plan(fmt, request.messages, request.tools)
            return session_free_turn(fmt, request.messages)
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
            raise RequestError(f"the model's chat template cannot render these messages ({type(exc).__name__}: "
                               f"{exc})", "messages") from None

    async def complete(self, request: ChatRequest, session: Session | None) -> tuple[dict[str, Any], list[str]]:
        """One completion: the response body and the content cut per sampled token (for streams)."""
        if self.client is None:
            raise RuntimeError("ChatService.start() was not called")
        if has_images(request.messages) and not takes_images(self.tokenizer):
            raise RequestError(f"model {self.model_name} takes no images: its tokenizer has no image processor. Fix: "
                               "send text only, or serve a vision-language model", "messages", 400, "images_not_supported")
        fmt = self._format(request)
        turn = self._plan(fmt, request, session)
        prompt = turn.prompt
        room = self.max_total_tokens - len(prompt) - 1  # one token kept for a forced end-of-turn
        if room < 1:
            raise RequestError(f"the conversation is {len(prompt)} tokens; with a reply it would exceed the server's "
                               f"{self.max_total_tokens} (env.max_total_tokens)", "messages", 400,
                               "context_length_exceeded")
        limit = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens, room)
        use_request = not self.override_sampling
        params = SamplingParams(
            temperature=request.temperature if use_request and request.temperature is not None else self.temperature,
            top_p=request.top_p if use_request and request.top_p is not None else self.top_p,
            max_new_tokens=limit, stop=list(request.stop), stop_token_ids=[fmt.end_of_turn_id])
        recorded = [1 - m for m in turn.segment.loss_mask[:turn.reused]] if turn.segment else []
        completion = await generate(self.client, list(prompt), turn.images,
                                    recorded + [1] * (len(prompt) - len(recorded)), params)
        # Nothing after an end-of-turn, at most `limit` tokens (as the agent loop keeps a turn).
        keep = min(len(completion.token_ids), limit)
        if fmt.end_of_turn_id in completion.token_ids[:keep]:
            keep = completion.token_ids.index(fmt.end_of_turn_id) + 1
        ids = list(completion.token_ids[:keep])
        logprobs, versions = list(completion.logprobs[:keep]), list(completion.policy_version[:keep])
        ended = bool(ids) and ids[-1] == fmt.end_of_turn_id
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        text = text.replace(fmt.end_of_turn, "")
        cut = not ended and (completion.finish_reason == "length" or keep < len(completion.token_ids))
        reply = assistant_reply(text, tool_call_format_of(self.tokenizer), request.parse_tools, cut, request.stop)
        token_texts = [self.tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                       for i in ids]
        lp_content = [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace")), "top_logprobs": []}
                      for t, lp in zip(token_texts, logprobs)] if request.logprobs else None
        body = completion_body(completion_id(), self.model_name, reply, len(prompt), len(ids), lp_content)
        if session is not None:
            record = {"id": body["id"], "time": time.time(), "prompt_ids": list(prompt), "sampled_ids": ids,
                      "logprobs": logprobs, "policy_version": versions, "finish_reason": reply.finish_reason,
                      "parse_errors": reply.parse_errors, "message": reply.message(), "images": len(turn.images),
                      "sampling": {"temperature": params.temperature, "top_p": params.top_p,
                                   "max_new_tokens": limit, "stop": params.stop}}
            session.commit(turn, request.messages, ids, logprobs, versions, fmt.end_of_turn_id, reply.recorded(),
                           record)
        return body, content_pieces(reply.content, [t.replace(fmt.end_of_turn, "") for t in token_texts])

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "tiderl"}]}


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})") from None


def create_app(service: ChatService) -> FastAPI:
    """The FastAPI app serving `service` (see the module docstring for the routes)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="tiderl serve", lifespan=lifespan)
    app.state.service = service
    store = service.store

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("tiderl serve: %s %s failed", request.method, request.url.path)
        return JSONResponse({"error": {"message": f"tiderl serve failed: {type(exc).__name__}: {exc}",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    async def chat(request: Request, session: Session | None) -> Any:
        chat_request = read_request(await _json_body(request))
        body, pieces = await service.complete(chat_request, session)
        if not chat_request.stream:
            return JSONResponse(body)
        chunks = stream_chunks(body, pieces, chat_request.include_usage)

        async def events() -> AsyncIterator[str]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": service.model_name, "engine_version": service.engine.version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return service.models()

    @app.post("/v1/chat/completions")
    async def plain_chat(request: Request) -> Any:
        return await chat(request, None)

    @app.post("/sessions", status_code=201)
    async def create_session(request: Request) -> JSONResponse:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object: {\"session_id\"?, \"task_id\"?, \"group_id\"?, "
                               "\"meta\"?}")
        meta = body.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise RequestError("'meta' must be an object", "meta")
        session = store.create(body.get("session_id"), str(body.get("task_id") or ""),
                               str(body.get("group_id") or ""), meta)
        return JSONResponse({"session_id": session.session_id, "base_url": f"/sessions/{session.session_id}/v1"},
                            status_code=201)

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        return store.get(session_id).to_dict()

    @app.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        store.delete(session_id)
        return {"session_id": session_id, "deleted": True}

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        if not isinstance(body, dict) or "reward" not in body:
            raise RequestError("the body must be {\"reward\": <number>, \"info\"?: {...}}", "reward")
        session = store.finish(session_id, body["reward"], body.get("info"))
        trajectories = session.trajectories()
        return {"session_id": session_id, "reward": session.reward, "requests": len(session.requests),
                "segments": [{"reason": s.reason, "turns": s.turns, "tokens": len(s.tokens),
                              "sampled_tokens": sum(s.loss_mask)} for s in session.segments],
                "trajectories": len(trajectories)}

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str) -> dict[str, Any]:
        store.get(session_id)
        return service.models()

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(session_id: str, request: Request) -> Any:
        return await chat(request, store.get(session_id, open_only=True))

    return app


class BackgroundServer:
    """Run an ASGI app with uvicorn on its own thread (`port=0`: a free port). Use as a context
    manager or call `start()`/`stop()`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self.host = host
        self.port = port
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self.thread = threading.Thread(target=self.server.run, name="tiderl-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the tiderl server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
            self.thread = None

    def __enter__(self):  # the started server itself
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def record_to(path: str | Path) -> Any:
    """An `on_finish` for `SessionStore`: append each finished session's trajectories to `path`
    as JSON lines (`save_trajectories`: the format `tiderl pretrain-value --trajectories` loads);
    a trajectory's images are written as PNG data URLs (`Trajectory.to_dict`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def write(session: Session) -> None:
        with lock:
            save_trajectories(session.trajectories(), path, mode="a")

    return write


def service_from_config(cfg: RunConfig, record: str | None = None) -> ChatService:
    """The model of `cfg` (`model.path`, the embedded default built when needed), its tokenizer
    with `model.chat_template` and `model.tool_call_format` applied, the engine `rollout.engine`
    names, and the sampling and budgets of `rollout.*` and `env.max_total_tokens`."""
    import torch

    from tiderl.agent.tool_parser import set_tool_call_format
    from tiderl.models.loading import check_device, load_policy, load_tokenizer
    from tiderl.models.startup import apply_chat_template
    from tiderl.rollout import make_engine

    check_device(cfg.model.device)
    torch.manual_seed(cfg.seed)
    path = cfg.model.path
    if path == "tiny":
        from tiderl.embedded.build import ensure_embedded_model
        from tiderl.envs.setup import load_setup

        path = str(ensure_embedded_model(cfg, load_setup(cfg)))
    tokenizer = load_tokenizer(path)
    apply_chat_template(tokenizer, cfg.model.chat_template)
    set_tool_call_format(tokenizer, cfg.model.tool_call_format)
    # Nothing else uses the loaded model: the engine takes it over instead of copying it.
    engine = make_engine(cfg, load_policy(path, cfg.model.dtype, cfg.model.device), tokenizer,
                         seed=cfg.seed, copy_model=False)
    name = "tiny" if cfg.model.path == "tiny" else Path(path).name
    store = SessionStore(on_finish=record_to(record) if record else None)
    return ChatService(engine, tokenizer, name, cfg.rollout.max_new_tokens, cfg.env.max_total_tokens,
                       cfg.rollout.temperature, cfg.rollout.top_p, store=store,
                       max_batch_size=cfg.rollout.engine_batch_size)


def serve(cfg: RunConfig, host: str = "127.0.0.1", port: int = 8000, record: str | None = None) -> None:
    """Serve `cfg`'s model until interrupted (`tiderl serve`)."""
    import uvicorn

    service = service_from_config(cfg, record)
    print(f"[tiderl] serving {service.model_name} at http://{host}:{port}/v1 (sessions: POST /sessions, then "
          f"http://{host}:{port}/sessions/<id>/v1)" + (f"; finished sessions -> {record}" if record else ""))
    uvicorn.run(create_app(service), host=host, port=port, log_level="info")
