"""Training on several processes: two processes with half the batch each follow one process with the
whole batch; the feature cache they share out is the one a single process writes; --resume works.

Real processes on gloo, on the embedded model and 16 generated ShapesVQA items: once launched as a
user launches them (`accelerate launch --multi_gpu --num_processes 2 -m arr_coc train --device cpu`),
otherwise forked from this process with torch.multiprocessing (the same command in each, seconds
cheaper than a launcher that imports torch again). The one-process runs are the same command here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from arr_coc.cli import main as cli_main
from arr_coc.paths import EMBEDDED_MODEL, SHIPPED_LAYER
from arr_coc_shapes import write_split
from arr_coc.distributed import LaunchError, Processes

ROOT = Path(__file__).resolve().parent.parent
SAME = 1e-6  # float32 rounding of the same training (two processes sum the batch's gradient in another order)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return str(write_split(tmp_path_factory.mktemp("shapes"), split="train", n=16, seed=3, canvas=(336, 336)))


def _launch(n: int, *args: str) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes n -m arr_coc train --device cpu ARGS` (a free port)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           "-m", "arr_coc", "train", "--device", "cpu", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, argv: tuple[str, ...]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A fork inherits the parent's accelerate singletons: an earlier test in this pytest process (the lmms-eval
    # plugin builds an Accelerator) leaves a one-process state that would make every child train alone.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    assert cli_main(list(argv)) == 0


def _spawn(n: int, *args: str, command: str = "train") -> None:
    """`python -m arr_coc COMMAND --device cpu ARGS` in n processes forked from this one (torch already
    imported: seconds cheaper than a launcher), on gloo."""
    argv = (command, "--device", "cpu", *args)
    torch.multiprocessing.start_processes(_rank, args=(n, _free_port(), argv), nprocs=n, start_method="fork")


def _train(*args: str) -> None:
    """The same command as one plain process, here."""
    assert cli_main(["train", *args]) == 0


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _log(folder: Path, stage: int) -> dict:
    return json.loads((folder / f"training_log_stage{stage}.json").read_text())


def _apart(a: Path, b: Path) -> tuple[float, float]:
    """(share of weights further apart than SAME, largest distance in units of the run's summed learning rate).

    AdamW's step is about lr x sign(gradient) wherever |gradient| >> eps, so the weights of one run are
    at most ~(summed lr) from its start, and where a gradient is itself at rounding level (~1e-8, about
    eps) the two runs' rounding can steer that one weight a fraction of a step apart.
    """
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    diff = torch.cat([(wa[k] - wb[k]).abs().reshape(-1) for k in wa])
    summed_lr = sum(r["lr"] for r in json.loads(next(a.glob("training_log_stage*.json")).read_text())["log"])
    return float((diff > SAME).float().mean()), float(diff.max()) / summed_lr


def test_two_processes_with_half_the_batch_follow_one_process_with_all_of_it_and_resume(data, tmp_path):
    stage1 = ["--data", data, "--stage", "1", "--steps", "6", "--eval-every", "3"]
    one, half, two = tmp_path / "one", tmp_path / "half", tmp_path / "two"
    _train(*stage1, "--batch-size", "8", "--out", str(one), "--feature-cache", str(tmp_path / "cache1"))
    _train(*stage1, "--batch-size", "4", "--out", str(half), "--feature-cache", str(tmp_path / "cache1"))
    # Two processes, 4 items each: launched by accelerate, stopped after 3 steps, resumed as two processes.
    shared = ["--batch-size", "4", "--out", str(two), "--feature-cache", str(tmp_path / "cache2")]
    _launch(2, *stage1, *shared, "--stop-after", "3")
    assert _log(two, 1)["step"] == 3 and _log(two, 1)["processes"] == 2
    _spawn(2, *stage1, *shared, "--resume")

    apart, furthest = _apart(one, two)
    assert apart <= 1e-3 and furthest < 0.1, (apart, furthest)
    apart, furthest = _apart(one, half)  # the same run with half the batch: the test can fail
    assert apart > 0.5 and furthest > 0.5, (apart, furthest)

    # The log is rank 0's, complete, with the global batch's losses and one validation per eval step.
    a, b = _log(one, 1), _log(two, 1)
    assert b["step"] == 6 and [r["step"] for r in b["log"]] == list(range(1, 7))
    for ra, rb in zip(a["log"], b["log"]):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5) and rb["lr"] == ra["lr"]
        assert rb.get("val_coverage") == pytest.approx(ra.get("val_coverage"))
    assert b["budget_spread"]["reference"] == pytest.approx(a["budget_spread"]["reference"], rel=1e-6)
    assert sorted(p.name for p in two.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                     "train_state_stage1.pt", "training_log_stage1.json"]

    # Extraction was shared out, and the cache is the one file a single process writes, byte for byte.
    (single,), (joined,) = (tmp_path / "cache1").iterdir(), (tmp_path / "cache2").iterdir()
    assert joined.name == single.name and joined.read_bytes() == single.read_bytes()


def test_stage2_two_processes_with_half_the_batch_follow_one_process(data, tmp_path):
    stage2 = ["--data", data, "--stage", "2", "--init", SHIPPED_LAYER, "--steps", "3", "--eval-every", "3",
              "--lr", "1e-3", "--rank-weight", "0.5", "--feature-cache", str(tmp_path / "cache")]
    one, half, two = tmp_path / "one", tmp_path / "half", tmp_path / "two"
    _train(*stage2, "--batch-size", "4", "--out", str(one))
    _train(*stage2, "--batch-size", "2", "--out", str(half))
    _spawn(2, *stage2, "--batch-size", "2", "--out", str(two))  # reads the cache the first run wrote
    apart, furthest = _apart(one, two)  # seen: 1 weight of 41,454 beyond 1e-6, at 0.02 x the summed lr
    assert apart <= 1e-3 and furthest < 0.1, (apart, furthest)
    apart, furthest = _apart(one, half)  # seen: 99.7% of the weights beyond 1e-6, the furthest at 2 x
    assert apart > 0.5 and furthest > 0.5, (apart, furthest)
    for ra, rb in zip(_log(one, 2)["log"], _log(two, 2)["log"]):
        for key in ("loss", "answer_loss", "ranking_loss", "soft_kept_share"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5), key


def test_uneven_shares_weigh_to_the_whole_batch_gradient(data):
    """Three processes with shares of 3, 3 and 4 items, some without boxes (not every share holds as many):
    the summed, weighed share gradients are the whole batch's (a plain mean of the share means, what
    averaging gradients as DDP does would give, is not)."""
    from arr_coc import ARRCOCConfig
    from arr_coc.data import read_jsonl
    from arr_coc.core.layer import ARRCOCLayer
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.training.features import extract_features
    from arr_coc.training.losses import batch_scores, ranking_loss

    feats = extract_features(ARRCOCQwen.from_pretrained(EMBEDDED_MODEL), list(read_jsonl(data))[:10], progress=False)
    for i in (0, 1, 5):  # items without boxes count in no ranking mean
        feats[i] = dataclasses.replace(feats[i], target=torch.zeros_like(feats[i].target))
    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig(strict=True).with_query_dim(192))

    def grads(losses) -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        sum(losses).backward()
        return torch.cat([p.grad.reshape(-1) for p in layer.parameters() if p.grad is not None])

    def loss(items):
        maps = batch_scores(layer, items)
        return ranking_loss(maps["relevance"], maps["valid"], maps["target"], 0.05)

    def boxed(items):
        return sum(bool(f.target.any()) for f in items)

    whole = grads([loss(feats)])
    shares = [feats[Processes(rank=r, world=3).share(len(feats))] for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 4] and len({boxed(s) for s in shares}) > 1  # uneven in both
    weighed = grads([Processes(rank=r, world=3).weigh(loss(s), boxed(s), boxed(feats)) for r, s in enumerate(shares)])
    plain = grads([loss(s) / 3 for s in shares])
    assert torch.allclose(weighed, whole, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(plain, whole, atol=1e-3, rtol=1e-2)


def test_shares_cover_everything_once_in_order():
    for world in range(1, 5):
        for n in range(0, 11):
            parts = [list(range(n))[Processes(rank=r, world=world).share(n)] for r in range(world)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_the_launchers_device_wins_and_a_different_one_is_refused():
    plain = Processes()
    assert plain.world == 1 and plain.is_main and plain.device_for("cuda:1") == "cuda:1"  # one process: as asked
    rank1 = Processes(rank=1, world=2, device=torch.device("cpu"))
    assert not rank1.is_main and rank1.device_for("auto") == "cpu" and rank1.device_for("cpu") == "cpu"
    with pytest.raises(LaunchError, match="pass --device auto"):
        rank1.device_for("cuda")


def test_a_cpu_launch_that_starts_one_of_several_processes_is_refused(monkeypatch):
    """`accelerate launch --cpu --num_processes 2` runs ONE process (accelerate 1.15: several CPU processes
    only through mpirun); its environment is recognised and the message names the commands that work."""
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (("ACCELERATE_USE_CPU", "True"), ("ACCELERATE_MIXED_PRECISION", "no"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchError, match="--multi_gpu --num_processes N .* --device cpu"):
        Processes.start("cpu")


def test_train_loads_the_vlm_as_asked_and_the_layer_trains_in_float32(data, tmp_path, monkeypatch):
    from arr_coc import ARRCOC

    loaded, load = [], ARRCOC.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        vlm = load(cls, *args, **kwargs)
        loaded.append((vlm.runtime.dtype, vlm.runtime.attn_implementation, vlm.device.type))
        return vlm

    monkeypatch.setattr(ARRCOC, "from_pretrained", classmethod(spy))
    out = tmp_path / "bf16"
    _train("--data", data, "--stage", "1", "--steps", "2", "--batch-size", "4", "--dtype", "bfloat16",
           "--attn-implementation", "eager", "--out", str(out))
    assert loaded == [(torch.bfloat16, "eager", "cpu")]
    assert {t.dtype for t in _weights(out).values()} == {torch.float32}
    assert _log(out, 1)["log"][-1]["loss"] > 0
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            _train("--data", data, "--stage", "1", "--device", "cuda", "--out", str(tmp_path / "never"))
        assert not (tmp_path / "never").exists()


def test_eval_shares_its_batches_and_reports_what_one_process_reports(data, tmp_path):
    """The evaluation harness on the same machinery: two processes run a share of the batches each, and
    rank 0 writes the report one process writes, item by item (only rank 0 writes)."""
    common = ["--data", data, "--methods", "none,random,arr_coc_trained", "--budgets", "0.1", "--batch-size", "2",
              "--limit", "8", "--quiet"]
    assert cli_main(["eval", "--device", "cpu", *common, "--out", str(tmp_path / "one.json")]) == 0
    _spawn(2, *common, "--out", str(tmp_path / "two.json"), command="eval")
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["n"] == one["n"] == 8 and two["ids"] == one["ids"]
    assert [(r["method"], r["status"]) for r in two["results"]] == [(r["method"], "ok") for r in one["results"]]
    for a, b in zip(one["results"], two["results"]):
        for key in ("accuracy", "correct", "answers", "item_coverage", "kept_tokens_mean", "n", "per_type"):
            assert b[key] == a[key], (a["method"], key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.json", "two.json"]


def test_stage2_refuses_an_attention_that_cannot_take_its_soft_mask(data, tmp_path):
    from types import SimpleNamespace

    from arr_coc.training.config import TrainConfig
    from arr_coc.training.loop import train

    # Refused before any feature is extracted: a front door that only says how its model attends is enough.
    vlm = SimpleNamespace(runtime=SimpleNamespace(attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match="--attn-implementation sdpa"):
        train(TrainConfig(stage=2, out=str(tmp_path / "never")), "", data, vlm=vlm, progress=False)
