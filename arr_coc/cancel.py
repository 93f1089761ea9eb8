"""Cancellation: model work stops at the next step boundary once its request is gone.

A caller that may abandon a request (the app, when a client cancels or disconnects) runs the work inside
`cancellable(token)` and calls `token.cancel()` from anywhere. The wrapper calls `checkpoint(step)` at its
step boundaries: after the vision tower, after selection, and, through a transformers `StoppingCriteria`
(`stopping_kwargs`), after the prefill and after each generated token. A checkpoint raises `Cancelled`
once the token is cancelled, so the work unwinds and its tensors are freed. Outside `cancellable` a
checkpoint is one ContextVar lookup and never raises, so library behaviour is unchanged.

`CancelToken(enforce=False)` only counts the checkpoints reached after cancellation (the tests' negative
control: the same work with its checks off keeps running).
"""

from __future__ import annotations

import contextvars
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class Cancelled(RuntimeError):
    """The request was cancelled; `step` is the boundary where its work stopped."""

    def __init__(self, step: str):
        super().__init__(f"the request was cancelled; its work stopped after {step}")
        self.step = step


class CancelToken:
    """Set once, from any thread; read at every checkpoint of the work it was installed for."""

    def __init__(self, enforce: bool = True):
        self._event = threading.Event()
        self.enforce = enforce
        self.steps = 0                    # checkpoints reached
        self.steps_after_cancel = 0       # checkpoints reached after cancel(): 1 when enforced (the one that stops)
        self.stopped_at: str | None = None
        self.reason: str | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        if not self._event.is_set():
            self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled (True) or the timeout passes (False)."""
        return self._event.wait(timeout)

    def check(self, step: str) -> None:
        self.steps += 1
        if self._event.is_set():
            self.steps_after_cancel += 1
            if self.enforce:
                self.stopped_at = step
                raise Cancelled(step)


_CURRENT: contextvars.ContextVar[CancelToken | None] = contextvars.ContextVar("arr_coc_cancel", default=None)


@contextmanager
def cancellable(token: CancelToken) -> Iterator[CancelToken]:
    """Run the block's model work under `token` (this thread / task only)."""
    reset = _CURRENT.set(token)
    try:
        yield token
    finally:
        _CURRENT.reset(reset)


def current_token() -> CancelToken | None:
    return _CURRENT.get()


def checkpoint(step: str) -> None:
    """A step boundary: raise `Cancelled` when the current request was cancelled; else nothing."""
    token = _CURRENT.get()
    if token is not None:
        token.check(step)


_CRITERIA: list[type] = []


def _criteria_class() -> type:
    """`StopOnCancel`, a transformers StoppingCriteria, defined on first use (transformers is imported lazily)."""
    if not _CRITERIA:
        import torch
        from transformers import StoppingCriteria

        class StopOnCancel(StoppingCriteria):
            """Checks the request's token after the prefill and after each generated token."""

            def __init__(self, token: CancelToken):
                self.token = token
                self.calls = 0

            def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
                self.calls += 1
                self.token.check("prefill" if self.calls == 1 else f"token {self.calls}")
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        _CRITERIA.append(StopOnCancel)
    return _CRITERIA[0]


def stopping_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`generate()` kwargs plus a StoppingCriteria for the current token (unchanged outside `cancellable`)."""
    token = _CURRENT.get()
    if token is None:
        return kwargs
    from transformers import StoppingCriteriaList

    criteria = StoppingCriteriaList(list(kwargs.get("stopping_criteria") or []))
    criteria.append(_criteria_class()(token))
    return {**kwargs, "stopping_criteria": criteria}
