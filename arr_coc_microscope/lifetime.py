"""A request's lifetime on the server: its model work stops when the request is gone.

Gradio 6 ends a request three ways, and the app turns each into `CancelToken.cancel()` (`arr_coc.cancel`),
which stops the handler's model work at its next step boundary:

- **cancel**: a client's `/cancel` makes Gradio cancel the coroutine running the request (the page's
  `run_ask`); its `CancelledError` cancels the token.
- **disconnect**: when a client's event stream closes, Gradio marks its requests dead (`Event.alive`) and
  moves on; `watch` polls that flag for the running request and cancels the token.
- **a cancel sent before the client knew the request's id**: gradio_client then posts `/reset` with the
  id once it learns it, and Gradio 6 answers that as a no-op, so the request would still run (issue 27:
  20 requests cancelled after 1.5 s, 13 ran to completion). `ResetMeansCancel` rewrites such a `/reset` into
  the `/cancel` Gradio itself would have handled: a waiting request leaves the queue, a running one is
  cancelled as above.

These read Gradio's queue (`Blocks._queue`, its events' `alive`, `session_hash` and `fn`); when something
is not where they expect it, they do nothing: a request is never stopped on a guess.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

logger = logging.getLogger("arr_coc.app")

TASK_SEPARATOR = "<gradio-sep>"     # Gradio names a request's task "<session>_<fn><gradio-sep><event id>"


def current_event_id() -> str | None:
    """The Gradio event id of the request this coroutine runs, from its task's name (or None)."""
    task = asyncio.current_task()
    name = task.get_name() if task is not None else ""
    return name.split(TASK_SEPARATOR, 1)[1] if TASK_SEPARATOR in name else None


def alive(demo: Any, event_id: str | None, session_hash: str | None) -> bool:
    """False once Gradio has marked this request dead (its client disconnected)."""
    queue = getattr(demo, "_queue", None)
    if queue is None:
        return True
    try:
        event = getattr(queue, "event_ids_to_events", {}).get(event_id) if event_id else None
        if event is not None:
            return bool(getattr(event, "alive", True))
        jobs = getattr(queue, "active_jobs", None) or []
        mine = [e for batch in jobs if batch for e in batch if getattr(e, "session_hash", None) == session_hash]
    except Exception:  # noqa: BLE001 - the queue changing under us: ask again next time
        return True
    return not session_hash or not mine or any(getattr(e, "alive", True) for e in mine)


async def watch(demo: Any, event_id: str | None, session_hash: str | None, token: Any, every_s: float) -> None:
    """Cancel `token` when the request's client disconnects; ends when the token is cancelled (or is cancelled)."""
    while not token.cancelled:
        await asyncio.sleep(every_s)
        if not alive(demo, event_id, session_hash):
            token.cancel("the client disconnected")
            return


class ResetMeansCancel:
    """ASGI middleware: `POST .../reset {"event_id": ...}` for a request still waiting or running becomes the
    `POST .../cancel {"session_hash", "fn_index", "event_id"}` Gradio handles (see the module's docstring)."""

    def __init__(self, app: Any, blocks: Any):
        self.app = app
        self.blocks = blocks

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if scope.get("method") != "POST" or not path.rstrip("/").endswith("/reset"):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        cancel = self._cancel_body(body)
        if cancel is not None:
            body = json.dumps(cancel).encode()
            base = path.rstrip("/")[: -len("/reset")]
            scope = dict(scope, path=f"{base}/cancel", raw_path=f"{base}/cancel".encode(),
                         headers=[(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())])
            logger.info("a late cancel (/reset) for request %s is handled as /cancel", cancel["event_id"])
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _cancel_body(self, body: bytes) -> dict | None:
        try:
            event_id = json.loads(body or b"{}").get("event_id")
            event = self.blocks._queue.event_ids_to_events.get(event_id) if event_id else None
        except Exception:  # noqa: BLE001 - not ours to judge: Gradio answers it as before
            return None
        fn_index = getattr(getattr(event, "fn", None), "_id", None)
        if event is None or fn_index is None:
            return None
        return {"session_hash": event.session_hash, "fn_index": fn_index, "event_id": event_id}
