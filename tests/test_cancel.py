"""Cancelled work really stops (issue 27): in the library, the app's handler and a live server.

No wall-clock thresholds: each test counts the model steps (language-model forward calls, selector calls)
taken after the request was cancelled, and a negative control runs the same work with the checks off
(`CancelToken(enforce=False)`) to show the count catches work that keeps running. Timeouts below only
guard against a hang; they never decide a verdict.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch

from _app_server import free_port, save_tiny_model, scene

from arr_coc.cancel import Cancelled, CancelToken, cancellable, checkpoint, current_token
from arr_coc.qwen import ARRCOCQwen
from arr_coc.pipeline.selection import SELECTORS

Q = "What color is the circle?"
HANG_GUARD_S = 120


class Steps:
    """Counts the language model's forward calls, and those made after the current request was cancelled."""

    def __init__(self, model: torch.nn.Module, cancel_at: int | None = None):
        self.calls = 0
        self.after_cancel = 0
        self.cancel_at = cancel_at
        self._hooks = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        token = current_token()
        if token is not None and token.cancelled:
            self.after_cancel += 1

    def _post(self, module, args, output):
        self.calls += 1
        token = current_token()
        if self.cancel_at is not None and self.calls == self.cancel_at and token is not None:
            token.cancel("test")

    def remove(self):
        for h in self._hooks:
            h.remove()


@pytest.fixture()
def wrapper(tiny_vlm):
    model, processor = tiny_vlm("qwen2_vl")
    return ARRCOCQwen(model, processor)


def _generate(w, token, make_image, **kw):
    with cancellable(token):
        return w.generate(make_image(120, 150, 0), Q, method="grid", budget=0.5, max_new_tokens=12,
                          min_new_tokens=12, **kw)


@pytest.mark.parametrize("enforce", [True, False])
def test_generation_stops_at_the_next_token(wrapper, make_image, enforce):
    """Cancelled during generation (after the 3rd LM forward: prefill + 2 tokens): with the checks, no
    forward runs after it; without them (the negative control) the other 9 tokens are generated."""
    steps = Steps(wrapper.model, cancel_at=3)
    token = CancelToken(enforce=enforce)
    try:
        if enforce:
            with pytest.raises(Cancelled) as info:
                _generate(wrapper, token, make_image)
            assert info.value.step == "token 3" and token.stopped_at == "token 3"
        else:
            answer, trace = _generate(wrapper, token, make_image)
            assert trace.new_tokens == 12
    finally:
        steps.remove()
    if enforce:
        assert steps.calls == 3 and steps.after_cancel == 0 and token.steps_after_cancel == 1
    else:
        assert steps.calls == 12 and steps.after_cancel == 9 and token.steps_after_cancel >= 9


@pytest.mark.parametrize("enforce", [True, False])
def test_cancelled_in_the_vision_tower_runs_no_selection_and_no_prefill(wrapper, make_image, enforce, monkeypatch):
    calls = {"selector": 0}

    def counting(ctx):
        calls["selector"] += 1
        return [torch.arange(k) for k in ctx.counts]

    monkeypatch.setitem(SELECTORS, "counting", counting)
    hook = wrapper.model.model.visual.register_forward_hook(lambda *a: current_token().cancel("test"))
    steps = Steps(wrapper.model)
    token = CancelToken(enforce=enforce)
    try:
        with cancellable(token):
            if enforce:
                with pytest.raises(Cancelled, match="after vision"):
                    wrapper.generate(make_image(120, 150, 0), Q, method="counting", max_new_tokens=4)
            else:
                wrapper.generate(make_image(120, 150, 0), Q, method="counting", max_new_tokens=4)
    finally:
        hook.remove()
        steps.remove()
    if enforce:
        assert calls["selector"] == 0 and steps.calls == 0
    else:
        assert calls["selector"] == 1 and steps.after_cancel >= 1   # the control: the work went on


@pytest.mark.parametrize("enforce", [True, False])
def test_cancelled_during_selection_runs_no_prefill(wrapper, make_image, enforce, monkeypatch):
    def cancelling(ctx):
        current_token().cancel("test")
        return [torch.arange(k) for k in ctx.counts]

    monkeypatch.setitem(SELECTORS, "cancelling", cancelling)
    steps = Steps(wrapper.model)
    token = CancelToken(enforce=enforce)
    try:
        with cancellable(token):
            if enforce:
                with pytest.raises(Cancelled, match="after selection"):
                    wrapper.generate(make_image(120, 150, 0), Q, method="cancelling", max_new_tokens=4)
            else:
                wrapper.generate(make_image(120, 150, 0), Q, method="cancelling", max_new_tokens=4)
    finally:
        steps.remove()
    assert steps.after_cancel == (0 if enforce else steps.calls) and (enforce or steps.calls >= 1)


def test_outside_a_request_checkpoints_do_nothing(wrapper, make_image):
    checkpoint("anything")   # no token: never raises
    a = wrapper.generate(make_image(120, 150, 0), Q, method="grid", budget=0.5, max_new_tokens=4)[0]
    token = CancelToken()
    with cancellable(token):
        b = wrapper.generate(make_image(120, 150, 0), Q, method="grid", budget=0.5, max_new_tokens=4)[0]
    assert a == b and token.steps >= 3 and token.steps_after_cancel == 0


def test_decoding_a_huge_image_stops_between_reads(tmp_path):
    """The validator reads files through a checkpoint: a cancelled request stops decoding."""
    from PIL import Image

    from arr_coc.validation.images import check_image

    path = tmp_path / "big.png"
    Image.new("RGB", (3000, 3000), (10, 200, 30)).save(path)
    token = CancelToken()
    token.cancel("test")
    with cancellable(token), pytest.raises(Cancelled, match="decoding"):
        check_image(str(path))


# ----------------------------------------------------------------------------- the app


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_cancel"))


@pytest.fixture(scope="module")
def scope(tiny_dir):
    from arr_coc_microscope import server

    return server.load(str(tiny_dir), device="cpu", max_new_tokens=6)


@pytest.fixture(scope="module")
def good_image(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("good_cancel") / "scene.png"
    scene(224, 168).save(path)
    return str(path)


class Gate:
    """A selector that holds the request until it is cancelled (so a test can cancel it mid-run), then lets
    it go on; it records the request's token and whether the cancellation reached it."""

    def __init__(self):
        self.entered = threading.Event()
        self.tokens: list[CancelToken] = []
        self.saw_cancel: list[bool] = []
        self.kept_alive: list[weakref.ref] = []

    def __call__(self, ctx):
        token = current_token()
        self.tokens.append(token)
        self.kept_alive.append(weakref.ref(ctx.visual_tokens[0]))
        self.entered.set()
        self.saw_cancel.append(token.wait(HANG_GUARD_S))
        return [torch.arange(k) for k in ctx.counts]


def test_the_handler_stops_a_cancelled_request_and_frees_its_memory(scope, good_image, monkeypatch):
    from arr_coc_microscope import handler

    gate = Gate()
    monkeypatch.setitem(SELECTORS, "gate", gate)
    steps = Steps(scope.vlm.backend.model)
    token = CancelToken()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_ask_in(token, scope, good_image)))
    try:
        worker.start()
        assert gate.entered.wait(HANG_GUARD_S)
        token.cancel("test")
        worker.join(HANG_GUARD_S)
    finally:
        steps.remove()
    assert result and result[0].error == handler.CANCELLED and result[0].answer_arr == ""
    assert gate.saw_cancel == [True] and token.stopped_at == "selection" and steps.after_cancel == 0
    assert scope.admission.requests == 0 and scope.admission.pixels == 0   # its place is given back
    gc.collect()
    assert gate.kept_alive[0]() is None      # the request's tensors are freed


def _ask_in(token, scope, image):
    from arr_coc_microscope import handler

    with cancellable(token):
        return handler.ask(scope, image, Q, True, 0.5, False, "gate")


def test_a_full_server_says_busy_and_the_next_request_is_served(scope, good_image, monkeypatch):
    from arr_coc_microscope import handler
    from arr_coc_microscope.admission import Admission

    full = Admission(max_requests=1, max_pixels=10**9)
    monkeypatch.setattr(scope, "admission", full)
    with full.admit(10**6):
        r = handler.ask(scope, good_image, Q)
    assert r.error.startswith("**Error:** The server is busy") and "Try again" in r.error and r.answer_baseline == ""
    assert handler.ask(scope, good_image, Q).error == ""
    pixels = Admission(max_requests=4, max_pixels=100_000)
    with pixels.admit(60_000):
        with pytest.raises(Exception, match="busy"):
            with pixels.admit(60_000):
                pass
        with pixels.admit(40_000):   # fits
            pass
    with pixels.admit(10**7):        # alone, any image is admitted
        pass


def _serve(scope, enforce: bool, monkeypatch):
    from gradio_client import Client

    from arr_coc import cancel
    from arr_coc_microscope import page, server

    if not enforce:   # the negative control: the same app with its cancellation checks off
        monkeypatch.setattr(cancel, "CancelToken", lambda: CancelToken(enforce=False))
    demo = page.build_demo(scope)
    port = free_port()
    server.serve(demo, port=port, prevent_thread_lock=True, quiet=True)
    return demo, f"http://127.0.0.1:{port}", Client(f"http://127.0.0.1:{port}", verbose=False,
                                                    analytics_enabled=False, download_files=False)


def _wait_idle(scope):
    done = threading.Event()
    for _ in range(HANG_GUARD_S * 10):
        if scope.admission.requests == 0:
            return
        done.wait(0.1)
    raise TimeoutError("the server kept working")


@pytest.mark.parametrize("enforce", [True, False])
def test_a_client_cancel_stops_the_servers_work(scope, good_image, monkeypatch, enforce):
    """gradio_client's job.cancel() mid-request: with the checks, no LM forward after it; without them the
    pruned run still prefills and generates."""
    from gradio_client import handle_file

    gate = Gate()
    monkeypatch.setitem(SELECTORS, "gate", gate)
    demo, url, client = _serve(scope, enforce, monkeypatch)
    steps = Steps(scope.vlm.backend.model)
    try:
        job = client.submit(handle_file(good_image), Q, True, 0.5, False, "gate", api_name="/ask")
        assert gate.entered.wait(HANG_GUARD_S)
        assert job.cancel()
        _wait_idle(scope)
        ok = client.predict(handle_file(good_image), Q, api_name="/ask")   # the next good request
    finally:
        steps.remove()
        client.close()
        demo.close()
    assert ok[-1] == "" and isinstance(ok[0], str)
    assert gate.saw_cancel == [True]
    if enforce:
        assert gate.tokens[0].stopped_at == "selection" and steps.after_cancel == 0
    else:
        assert steps.after_cancel >= 1


def test_a_disconnected_client_stops_the_servers_work(scope, good_image, monkeypatch):
    """A raw client that closes its event stream mid-request: Gradio marks the request dead, the app cancels it."""
    import httpx

    gate = Gate()
    monkeypatch.setitem(SELECTORS, "gate", gate)
    demo, url, client = _serve(scope, True, monkeypatch)
    steps = Steps(scope.vlm.backend.model)
    try:
        config = httpx.get(f"{url}/config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "ask")
        with open(good_image, "rb") as f:
            uploaded = httpx.post(f"{url}/gradio_api/upload", files={"files": f}, timeout=30).json()[0]
        session = "disconnecting-client"
        joined = httpx.post(f"{url}/gradio_api/queue/join", timeout=30, json={
            "data": [{"path": uploaded, "meta": {"_type": "gradio.FileData"}}, Q, True, 0.5, False, "gate"],
            "fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None})
        assert joined.status_code == 200, joined.text
        with httpx.stream("GET", f"{url}/gradio_api/queue/data", params={"session_hash": session},
                          timeout=HANG_GUARD_S) as stream:
            for line in stream.iter_lines():
                if gate.entered.is_set() or "process_starts" in line:
                    break
            assert gate.entered.wait(HANG_GUARD_S)
        # the stream is closed: the client is gone
        assert gate.tokens[0].wait(HANG_GUARD_S)
        _wait_idle(scope)
    finally:
        steps.remove()
        client.close()
        demo.close()
    token = gate.tokens[0]
    assert token.reason == "the client disconnected" and token.stopped_at == "selection" and steps.after_cancel == 0


def test_a_cancel_sent_before_the_client_knew_the_request_id_still_stops_it(scope, good_image, monkeypatch):
    """gradio_client posts /reset with the request's id when it was cancelled before it learned the id;
    Gradio 6 ignores that, the app treats it as /cancel (arr_coc_microscope.lifetime.ResetMeansCancel)."""
    import httpx
    from gradio_client import handle_file

    gate = Gate()
    monkeypatch.setitem(SELECTORS, "gate", gate)
    demo, url, client = _serve(scope, True, monkeypatch)
    steps = Steps(scope.vlm.backend.model)
    try:
        job = client.submit(handle_file(good_image), Q, True, 0.5, False, "gate", api_name="/ask")
        assert gate.entered.wait(HANG_GUARD_S)
        event_id = job.communicator.event_id
        reply = httpx.post(f"{url}/gradio_api/reset", json={"event_id": event_id}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert gate.tokens[0].wait(HANG_GUARD_S)
        _wait_idle(scope)
    finally:
        steps.remove()
        client.close()
        demo.close()
    assert gate.tokens[0].stopped_at == "selection" and steps.after_cancel == 0
