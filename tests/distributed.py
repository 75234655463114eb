"""Real ranks for tests: N processes on gloo (DS_ACCELERATOR=cpu), started with
torch.multiprocessing's spawn and joined through env://. No launcher, no mocks: each rank runs the
same DeepSpeed code a ``deepspeed --num_gpus N`` launch runs.

Rank functions live here (spawn imports them by module name) and write their results as JSON
into the test's tmp folder; ``spawn`` returns them in rank order.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
SMALL_DATA = dict(default_pairs=1500, default_vocab_size=400, max_tokens=600)


def _ports():
    """Ports for this test process, each tried once: below the system's ephemeral range, from which
    connections take their local ports (a port merely found free there can be taken by one before a
    rank binds it), in a block of its own for each pytest-xdist worker, so no two tests of a run,
    beside each other or one after the other, are handed the same port."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = 20000 + 1500 * worker
    for port in range(first, first + 1500):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still closing
                continue
        yield port
    raise RuntimeError(f"no free port left in {first}..{first + 1499}")


_PORTS = _ports()


def free_port() -> int:
    return next(_PORTS)


def _entry(rank: int, world: int, port: int, out: str, fn_name: str, kwargs: dict, accelerator: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR=accelerator)
    import torch

    if accelerator == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    try:
        result = globals()[fn_name](**kwargs)
        error = None
    except BaseException as e:  # reported to the parent, which fails the test with it
        result, error = None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"result": result, "error": error}))
    if error:
        os._exit(1)  # do not wait in a collective for ranks that will never come
    from admin_ds import distributed

    for training in _OPENED:  # engines hold process groups: release them before the teardown
        training.close()
    distributed.shutdown()


def spawn(world: int, fn_name: str, out: Path, accelerator: str = "cpu", **kwargs) -> list:
    """Run ``fn_name(**kwargs)`` on ``world`` ranks of DeepSpeed's ``accelerator`` ("cpu": gloo;
    "cuda": one GPU per rank, NCCL); returns each rank's result."""
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    port = free_port()
    ctx = mp.start_processes(_entry, args=(world, port, str(out), fn_name, kwargs, accelerator), nprocs=world,
                             join=False, start_method="spawn")
    exited = None
    try:
        while not ctx.join(timeout=300):
            pass
    except mp.ProcessRaisedException as e:
        raise AssertionError(str(e)) from None
    except mp.ProcessExitedException as e:
        exited = e  # a rank that failed exits non-zero on purpose: its JSON says why
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        if not f.exists():
            raise AssertionError(f"rank {r} wrote no result" + (f" ({exited})" if exited else ""))
        d = json.loads(f.read_text())
        if d["error"]:
            raise AssertionError(f"rank {r} failed:\n{d['error']}")
        results.append(d["result"])
    if exited is not None:  # every rank succeeded, yet one did not exit cleanly (e.g. SIGABRT at exit)
        raise AssertionError(f"all ranks finished their work, but a rank did not exit cleanly: {exited}")
    return results


# ------------------------------------------------------------------------------------------------
# Rank functions
# ------------------------------------------------------------------------------------------------

_OPENED: list = []  # runs set up in this rank, closed before it leaves the process group


def _training(run_overrides: list[str], ds: dict, tmp: str, hooks=None):
    from admin_ds.inference.scoring import score
    from admin_ds.inference.translate import translate
    from admin_ds.train.evaluator import BleuTools
    from admin_ds.train.loop import Training
    from admin_ds.train.run_config import load_run_config

    ds_path = Path(tmp, f"ds_{os.environ['RANK']}.json")
    ds_path.write_text(json.dumps(ds))
    training = Training(load_run_config(None, run_overrides), str(ds_path), hooks, BleuTools(translate, score))
    _OPENED.append(training)
    training.setup()
    return training


def train_with_slow_bleu(run_overrides: list[str], ds: dict, tmp: str, delay_s: float) -> dict:
    """A whole run whose BLEU decoding on rank 0 takes ``delay_s`` longer than it would (a long
    test set, a slow model): the real translate, started late. Returns the run's summary."""
    import time

    from admin_ds.inference.scoring import score
    from admin_ds.inference.translate import translate
    from admin_ds.train.evaluator import BleuTools
    from admin_ds.train.loop import Training
    from admin_ds.train.run_config import load_run_config

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return translate(*args, **kwargs)

    ds_path = Path(tmp, f"ds_{os.environ['RANK']}.json")
    ds_path.write_text(json.dumps(ds))
    training = Training(load_run_config(None, run_overrides), str(ds_path), None, BleuTools(slow, score))
    _OPENED.append(training)
    training.setup()
    return training.fit()


def _checksums(state):
    return None if state is None else {n: v.double().sum().item() for n, v in state.items()}


def _profile(t):
    return None if t.profile is None else {st: t.profile.omega(st) for st in ("encoder", "decoder")}


def read_params(engine, names) -> dict:
    """Full fp32 values of named parameters, (module tensor, optimizer master copy or None): what
    the tests check omega against in every copy (admin_ds/train/engine.py write_params)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(engine.module.named_parameters())
    out = {}
    with torch.no_grad():
        for name in names:
            p = params[name]
            if hasattr(p, "ds_id") and hasattr(p, "ds_shape"):  # a ZeRO-3 partition: gathered to read
                with deepspeed.zero.GatheredParameters([p]):
                    lp = p.data.detach().float().clone()
            else:
                lp = p.data.detach().float().clone()
            hp = safe_get_full_fp32_param(p)
            out[name] = (lp, None if hp is None else hp.detach().float().clone())
    return out


def train_updates(run_overrides: list[str], ds: dict, tmp: str, updates: int, read_omega: bool = False,
                  save: bool = False) -> dict:
    """Profile (or resume), run ``updates`` updates (then save, if asked); report losses, grad
    norms, skipped steps (and which the guard would count as non-finite), fp16 loss scales, peak GPU memory, omega, and per-parameter checksums of
    the whole model's state (rank 0): each parameter's sum and sum of magnitudes."""
    import torch

    t = _training(run_overrides, ds, tmp)
    resumed = t.try_resume()
    if not resumed:
        t.establish_profile()
    losses, norms, skipped, nonfinite, scales = [], [], [], [], []
    engine = t.runner.engine
    if t.runner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(updates):
        stats = t.train_update()
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        skipped.append(stats["skipped"])
        nonfinite.append(stats["nonfinite"])
        scales.append(engine.optimizer.loss_scale if t.layout["precision"] == "fp16" else None)
    peak_mem = torch.cuda.max_memory_allocated() if t.runner.device.type == "cuda" else None
    omega = None
    if read_omega:
        engine = t.runner.engine
        names = [n for n, _ in engine.module.named_parameters() if n.endswith("omega")]
        vals = read_params(engine, names)
        omega = {n: [lp.tolist(), None if hp is None else hp.tolist()] for n, (lp, hp) in vals.items()}
    state = t.runner.state_dict()
    params = _checksums(state)
    magnitudes = None if state is None else {n: v.double().abs().sum().item() for n, v in state.items()}
    if save:
        t.save()
    return {"losses": losses, "grad_norms": norms, "profile": _profile(t), "omega": omega, "params": params,
            "magnitudes": magnitudes, "resumed": resumed, "update": t.state.update, "skipped": skipped, "loss_scales": scales,
            "peak_mem": peak_mem, "nonfinite": nonfinite}


def profile_only(run_overrides: list[str], ds: dict, tmp: str) -> dict:
    """The distributed profile plus this rank's profiling batch (to rebuild the global batch)."""
    t = _training(run_overrides, ds, tmp)
    first = t.profiling_batch()
    t.establish_profile()
    return {"profile": _profile(t), "src": first["src_tokens"].tolist(), "tgt": first["tgt_in_tokens"].tolist(),
            "tokens": t.profile.tokens}


def profile_batches(run_overrides: list[str], ds: dict, tmp: str, batches: list[dict]) -> dict:
    """The distributed profile of given padded batches, one per data-parallel rank ({"src": rows,
    "tgt": rows} of token ids, tgt starting with EOS), with each formula; and the decoder layers
    this rank's stage holds."""
    import torch

    t = _training(run_overrides, ds, tmp)
    mine = batches[t.runner.dp_rank]
    src, tgt_in = torch.tensor(mine["src"]), torch.tensor(mine["tgt"])
    pad, eos = t.cfg.pad_idx, t.cfg.eos_idx
    target = torch.cat([tgt_in[:, 1:], torch.full_like(tgt_in[:, :1], pad)], 1)
    lengths = tgt_in.ne(pad).sum(1)
    target[torch.arange(len(lengths)), lengths - 1] = eos  # the target ends where the input does
    batch = {"src_tokens": src, "tgt_in_tokens": tgt_in, "target": target,
             "ntokens": int(lengths.sum()), "nsentences": len(lengths)}
    out = {}
    for formula in ("reference", "paper"):
        t.run.admin.formula = formula  # the runner reads its run config's admin section
        profile = t.runner.profile(batch)
        out[formula] = {"encoder": profile.omega("encoder"), "decoder": profile.omega("decoder")}
    stage = getattr(t.runner, "stage", None)
    held = t.runner.model if stage is None else stage.model
    return {**out, "stage_decoder_layers": held.decoder_layers.indices()}


# ---- reliability (tests/test_reliability.py) ----------------------------------------------------


def train_and_save(run_overrides: list[str], ds: dict, tmp: str, updates: int, save_at: list = (),
                   report_at: list = ()) -> dict:
    """Resume (or profile), run ``updates`` updates, saving after those in ``save_at``; report the
    losses, the profile's omega, and the whole model's parameter checksums (omega included)
    after the updates in ``report_at``."""
    t = _training(run_overrides, ds, tmp)
    resumed = t.try_resume()
    if not resumed:
        t.establish_profile()
    start, losses, params = t.state.update, {}, {}
    for _ in range(updates):
        stats = t.train_update()
        u = t.state.update
        losses[u] = stats["loss"]
        if u in report_at:
            state = _checksums(t.runner.state_dict())
            if state is not None:
                params[u] = state
        if u in save_at:
            t.save()
    return {"resumed": resumed, "start": start, "losses": losses, "params": params, "profile": _profile(t)}


def fit_with_faults(run_overrides: list[str], ds: dict, tmp: str, fault: str) -> dict:
    """``Training.fit`` with test faults (tests/faults.py); records a checksum of this rank's
    module parameters after every update, then reloads the newest checkpoint as a resume would."""
    from faults import Faults

    from admin_ds.train.guard import GuardState
    from admin_ds.train.hooks import Hooks

    t = _training(run_overrides, ds, tmp, hooks=Faults(fault).install(Hooks()))
    digests: dict = {}
    inner = t.train_update

    def recorded():
        stats = inner()
        digests.setdefault(t.state.update, []).append(
            sum(p.detach().double().sum().item() for p in t.runner.engine.module.parameters()))
        return stats

    t.train_update = recorded
    summary = t.fit()
    t.guard.state = GuardState()  # as in a new process
    t.restore(t.checkpoints.plan_resume(t.layout, t.cfg, t.manifest))
    return {"summary": summary, "digests": digests, "reloaded_guard": t.guard.state_dict(),
            "reloaded_lr": t.runner.engine.get_lr()[0], "reloaded_update": t.state.update}


# ---- process-group teardown (tests/test_cluster.py) -----------------------------------------------


def backend_threads() -> list[str]:
    """Names of this process's gloo threads (Linux: /proc/self/task/*/comm)."""
    names = [Path(t, "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    return [n for n in names if "gloo" in n]


def command_then_threads(command: str, argv: list[str]) -> dict:
    """Run a launch/ command's ``main`` in this rank (it joins and leaves the process group
    itself), then report the gloo threads still alive and the command's exit status."""
    import runpy

    module = runpy.run_path(str(REPO / "launch" / f"{command}.py"), run_name="launched")
    status = module["main"](argv)
    return {"status": status, "after": backend_threads()}










def stage_parameters(run_overrides: list[str], ds: dict, tmp: str) -> dict:
    """This rank's module parameters (name -> checksum) and their element count, right after the
    engine is built (tests/test_pipeline.py)."""
    t = _training(run_overrides, ds, tmp)
    params = dict(t.runner.engine.module.named_parameters())
    return {"params": {n: p.detach().double().sum().item() for n, p in params.items()},
            "numel": sum(p.numel() for p in params.values())}
