"""``make gpu-check``: everything one CUDA GPU can show, in a few minutes, one line per check.

On a host with a CUDA GPU (one is enough: an H100 or H200), each check runs on it and
prints ``PASS``, ``FAIL`` or ``SKIP`` with what it saw:

* a 1-rank NCCL pool: the rank pinned to the chosen device with ``CUDA_VISIBLE_DEVICES``
  narrowed to it and ``LOCAL_RANK`` = the index it sees; a ``%%fsdp`` cell; pulls and
  probes that return CPU values; NCCL's flight recorder entries in ``pool.trace()``;
* a rank waiting for its GPU behind an unfinished NCCL collective is reported as blocked
  in it (``torch.cuda._sleep`` keeps the GPU busy ahead of an ``all_reduce``);
* the NCCL watchdog does not end a rank stopped at a breakpoint past ``pg_timeout``, and
  does end one that is not (the control);
* a checkpoint save, async save (staging from CUDA) and load of an FSDP model on CUDA;
* FSDP at world size 1 with mixed precision and with CPU offload, against a plain model;
  meta-device init materialized on CUDA;
* the single-GPU bench figures (steps/s, MFU, peak memory of ``bench/gpu.py``'s training
  step at world size 1);
* ``pytest -m cuda``: the CUDA-marked tests (one GPU suffices for each);
* last, this process (the notebook kernel's stand-in, which started every pool) and the
  engine forker its engines came from hold no ``/dev/nvidia*`` file, and this process has
  no compute context in ``nvidia-smi``.

Without a GPU it says so and runs the same script's checks that need none, on CPU ranks
over gloo (a dry run of the script itself: the pool, ``%%fsdp``, pulls, the flight
recorder, checkpoints, the kernel staying CUDA-free, the bench entry points), and exits 0
when they pass. CI runs that dry run. Exit status 1 when a check fails.

The 2+ GPU checks (``make bench-gpu``, the 2-rank cases of the CUDA tests) stay for hosts
with more GPUs: one GPU cannot hold two NCCL ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

#: The bench's training step at world size 1 (kept small: the check has minutes).
BENCH_SIZE = {"dim": 1024, "blocks": 4, "batch": 16}
PYTEST_TIMEOUT_S = 300


@dataclasses.dataclass
class Context:
    """What the checks share: ``gpu`` (a CUDA device is visible), ``device`` (the index
    the pool uses) and the running pool, started by the first check that needs it."""

    gpu: bool
    device: int = 0
    pool: Any = None
    shell: Any = None
    workdir: str = ""


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    needs_gpu: bool
    run: Callable[[Context], str]


# ---------------------------------------------------------------------------- rank side


def rank_facts() -> dict[str, Any]:
    """Where this rank runs (called on the rank)."""
    import torch

    facts: dict[str, Any] = {
        "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if torch.cuda.is_available():
        facts["current_device"] = torch.cuda.current_device()
        facts["device_count"] = torch.cuda.device_count()
    return facts


def _model(seed: int = 0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _train(model: Any, device: Any, steps: int = 3) -> list[float]:
    import torch

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(8, 16, device=device)
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def fsdp_variants() -> dict[str, Any]:
    """FSDP at world size 1, mixed precision and CPU offload, against a plain model
    (called on the rank)."""
    import torch

    from fsdp_interactive.fsdp import CPUOffload, MixedPrecision
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    reference = _train(_model().to(device), device)
    out: dict[str, Any] = {"reference": reference}
    variants = {"bf16": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}}
    if cuda:
        variants["offload"] = {"cpu_offload": CPUOffload(offload_params=True)}
    for label, kwargs in variants.items():
        fsdp = FSDP(_model(), device_id=device if cuda else None, use_orig_params=True, **kwargs)
        local = fsdp.module[0].weight.to_local()
        out[label] = {
            "losses": _train(fsdp, device),
            "shard_device": str(local.device),
            "pinned": bool(local.is_pinned()) if local.device.type == "cpu" and cuda else None,
        }
    return out


def meta_init() -> dict[str, Any]:
    """A meta-device model wrapped with FSDP: where its parameters end up (on the rank)."""
    import torch

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    with torch.device("meta"):
        model = _model()
    cuda = torch.cuda.is_available()
    kwargs = {"device_id": torch.cuda.current_device()} if cuda else {}
    fsdp = FSDP(model, use_orig_params=True, **kwargs)
    params = [p.to_local() for p in fsdp.parameters()]
    return {
        "devices": sorted({str(p.device) for p in params}),
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
    }


def checkpoint_round_trip(folder: str) -> dict[str, Any]:
    """Save, async-save (staged from the device) and load an FSDP model (on the rank)."""
    import torch

    from fsdp_interactive import checkpoint
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = FSDP(_model(), device_id=device if cuda else None, use_orig_params=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, device, steps=1)
    saved = {n: p.full_tensor().cpu().clone() for n, p in model.named_parameters()}
    checkpoint.save(os.path.join(folder, "sync"), model, optim, step=1)
    handle = checkpoint.async_save(os.path.join(folder, "async"), model, optim, step=1)
    with torch.no_grad():  # changed right after staging: must not leak into the checkpoint
        for p in model.parameters():
            p.add_(1.0)
    handle.wait()
    loaded = {}
    for name in ("sync", "async"):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        checkpoint.load(os.path.join(folder, name), model, optim)
        loaded[name] = all(
            torch.equal(p.full_tensor().cpu(), saved[n]) for n, p in model.named_parameters()
        )
    return {"device": str(device), "loaded_equal": loaded}


def gpu_busy_then_all_reduce(seconds: float) -> None:
    """Keep the GPU busy for about ``seconds``, queue an all_reduce behind it and wait for
    the result: the rank then waits for its GPU behind an unfinished NCCL collective."""
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize()
    began = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    cycles_per_s = 100_000_000 / (time.perf_counter() - began)
    torch.cuda._sleep(int(cycles_per_s * seconds))
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    t.item()


# ---------------------------------------------------------------------------- checks


def _pool(ctx: Context) -> Any:
    if ctx.pool is None or not ctx.pool.running:
        from IPython import get_ipython
        from IPython.testing.globalipapp import start_ipython

        from fsdp_interactive.notebook.magics import current_pool

        start_ipython()
        ctx.shell = get_ipython()
        ctx.shell.run_line_magic("load_ext", "fsdp_interactive")
        devices = str(ctx.device) if ctx.gpu else "cpu"
        ctx.shell.run_line_magic("fsdp", f"start -n 1 --devices {devices}")
        ctx.pool = current_pool()
        if ctx.pool is None or not ctx.pool.running:
            raise AssertionError("%fsdp start did not start a pool")
    return ctx.pool


def check_pool(ctx: Context) -> str:
    pool = _pool(ctx)
    record = pool.topology[0]
    facts = pool.call(rank_facts)[0]
    want_backend = "nccl" if ctx.gpu else "gloo"
    assert record.backend == want_backend, record
    assert facts["LOCAL_RANK"] == "0", facts
    if ctx.gpu:
        assert record.device == "cuda:0" and record.visible_devices == str(ctx.device), record
        assert facts["CUDA_VISIBLE_DEVICES"] == str(ctx.device), facts
        assert facts["current_device"] == 0 and facts["device_count"] == 1, facts
    else:
        assert record.device == "cpu", record
    out = pool.run("dist.all_reduce(t := torch.ones(1, device=device)); t.item()", stream=False)
    assert out.results == {0: "1.0"}, out.results
    return f"rank 0 on {record.device} ({record.backend}), {facts}"


def check_cell_magic(ctx: Context) -> str:
    _pool(ctx)
    ctx.shell.run_cell_magic(
        "fsdp",
        "",
        "x = torch.arange(4.0, device=device)\ndist.all_reduce(x)\nprint(x.sum().item())",
    )
    (value,) = ctx.pool.pull("x")
    assert type(value).__name__ == "Tensor" and value.device.type == "cpu", value
    return "%%fsdp ran a collective; x came back as a CPU tensor"


def check_pulls_and_probes(ctx: Context) -> str:
    from fsdp_interactive import inspect as probes

    pool = _pool(ctx)
    pool.run(
        "from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP\n"
        "from bench.gpu_check import _model\n"
        "model = FSDP(_model(), device_id=device if device.type == 'cuda' else None, "
        "use_orig_params=True)\n"
        "model(torch.randn(4, 16, device=device)).sum().backward()\n"
        "nested = {'w': [model.module[0].weight], 'grad': model.module[0].weight.grad}\n",
        stream=False,
    )
    (nested,) = pool.pull("nested")
    tensors = [nested["w"][0], nested["grad"]]
    assert all(type(t).__name__ == "Tensor" and t.device.type == "cpu" for t in tensors), tensors
    (call_result,) = pool.call(_device_tensors)
    assert all(t.device.type == "cpu" for t in call_result.values()), call_result
    (layout,) = pool.call(probes.layout, _ns("model"))
    (norms,) = pool.call(probes.grad_norms, _ns("model"))
    return f"pull, call and probes are CPU-only ({type(layout).__name__}, {type(norms).__name__})"


class _ns:
    """A name of the rank's namespace, looked up there when the call runs."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Any:
        return (_lookup, (self.name,))


def _lookup(name: str) -> Any:
    from IPython import get_ipython

    return get_ipython().user_global_ns[name]


def _device_tensors() -> dict[str, Any]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"plain": torch.ones(2, device=device), "param": torch.nn.Parameter(torch.ones(1))}


def check_flight_recorder(ctx: Context) -> str:
    pool = _pool(ctx)
    trace = pool.trace(last=10)
    dump = trace.dumps[0]
    assert dump.note is None, dump.note
    want = "nccl" if ctx.gpu else "gloo"
    records = [r for r in dump.records if r.backend == want]
    assert records and all(r.completed for r in records), dump.records
    return f"{len(records)} {want} entries, e.g. {records[-1].op} #{records[-1].seq} done"


def check_checkpoint(ctx: Context) -> str:
    pool = _pool(ctx)
    folder = tempfile.mkdtemp(prefix="gpu-check-ckpt-", dir=ctx.workdir)
    (result,) = pool.call(checkpoint_round_trip, folder)
    assert result["loaded_equal"] == {"sync": True, "async": True}, result
    return f"save, async save and load on {result['device']} round-trip exactly"


def check_fsdp_variants(ctx: Context) -> str:
    (result,) = _pool(ctx).call(fsdp_variants, timeout=240)
    reference = result["reference"]
    lines = []
    for label, tol in (("bf16", 5e-2), ("offload", 1e-5)):
        if label not in result:
            continue
        got = result[label]["losses"]
        assert all(
            abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(got, reference, strict=True)
        ), (
            label,
            got,
            reference,
        )
        lines.append(f"{label} on {result[label]['shard_device']}")
    if "offload" in result:
        assert result["offload"]["shard_device"] == "cpu" and result["offload"]["pinned"], result
    return "losses match the plain model: " + ", ".join(lines)


def check_meta_init(ctx: Context) -> str:
    (result,) = _pool(ctx).call(meta_init)
    want = ["cuda:0"] if ctx.gpu else ["cpu"]
    assert result["devices"] == want and result["finite"], result
    return f"meta parameters materialized on {result['devices'][0]}"


def check_blocked_behind_nccl(ctx: Context) -> str:
    from fsdp_interactive.pool import RankTimeout

    pool = _pool(ctx)
    pool.run("from bench.gpu_check import gpu_busy_then_all_reduce", stream=False)
    try:
        pool.run("gpu_busy_then_all_reduce(20)", timeout=5, stream=False)
    except RankTimeout as timed_out:
        where = timed_out.where[0]
        assert "behind nccl all_reduce" in where, str(timed_out)
        report = pool.interrupt()
        assert list(report.blocked) == [0] and pool.needs_restart, str(report)
        with contextlib.suppress(KeyboardInterrupt):
            timed_out.wait(120)
        pool.restart()
        return f"timeout and interrupt say: {where}"
    raise AssertionError("the cell did not time out while its GPU was busy")


def check_watchdog_hold(ctx: Context) -> str:
    """A rank at a breakpoint past pg_timeout survives; the control without one does not."""
    from fsdp_interactive.pool import Pool, RankDied

    cell = (
        "from bench.gpu_check import gpu_busy_then_all_reduce\n"
        "import fsdp_interactive, threading\n"
        "{pause}\n"
        "print('alive')\n"
    )
    queued = "threading.Thread(target=gpu_busy_then_all_reduce, args=(15,)).start()\n"
    held = queued + (
        "fsdp_interactive.breakpoint(rank=0, commands=['!import time; time.sleep(25)', 'c'])"
    )
    with Pool(devices=[ctx.device], pg_timeout=6, show_topology=False) as pool:
        out = pool.run(cell.format(pause=held), stream=False, timeout=120)
        assert "alive" in out.stdout[0], out.stdout
    control = queued + "import time\ntime.sleep(25)"
    with Pool(devices=[ctx.device], pg_timeout=6, show_topology=False) as pool:
        try:
            pool.run(cell.format(pause=control), stream=False, timeout=120)
        except RankDied as died:
            return (
                f"held rank survived 25 s past pg_timeout=6 s; unheld control ended ({died.codes})"
            )
    raise AssertionError("the control rank was not ended by the NCCL watchdog")


def check_bench_entry_points(ctx: Context) -> str:
    from bench import gpu, ranks

    for function, wanted in ((gpu._rank_train, ["size", "steps", "reps"]),):
        got = list(inspect.signature(function).parameters)
        assert got == wanted, f"bench.gpu.{function.__name__}{got}: expected {wanted}"
    assert callable(ranks.run_on_ranks) and callable(gpu.cuda_devices)
    return "bench.gpu._rank_train(size, steps, reps) and bench.ranks.run_on_ranks are in place"


def check_bench_figures(ctx: Context) -> str:
    from bench import gpu
    from bench.models import ModelSize
    from bench.ranks import run_on_ranks

    size = ModelSize(**BENCH_SIZE)
    (train,) = run_on_ranks(1, gpu._rank_train, size, 3, 3, backend="nccl")
    flops = 6 * size.parameters * size.batch
    parts = []
    for name, rates in train["rates"].items():
        best = max(rates)
        mfu = best * flops / train["peak_flops"]
        parts.append(
            f"{name}: {best:.1f} steps/s, MFU {mfu:.1%}, peak {train['memory'][name] / 2**20:.0f} MiB"
        )
    return f"matmul peak {train['peak_flops'] / 1e12:.0f} TFLOP/s; " + "; ".join(parts)


def check_cuda_tests(ctx: Context) -> str:
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    command += ["tests", "--timeout", str(PYTEST_TIMEOUT_S)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S + 60, check=False
    )
    tail = [line for line in done.stdout.strip().splitlines() if line.strip()][-1:]
    assert done.returncode == 0, "\n".join(done.stdout.splitlines()[-40:])
    return tail[0] if tail else "no output"


def check_kernel_cuda_free(ctx: Context) -> str:
    from fsdp_interactive.pool.processes._devices import cuda_handles

    handles = cuda_handles()
    assert handles == [], f"this process holds {handles}"
    detail = "no /dev/nvidia* file open"
    forker = getattr(getattr(ctx.pool, "_processes", None), "_forker", None)
    if forker is not None and forker.running():
        held = cuda_handles(forker.pid)
        assert held == [], f"the engine forker (pid {forker.pid}) holds {held}"
        detail += " here or in the engine forker"
    smi = shutil.which("nvidia-smi")
    if ctx.gpu and smi:
        listed = subprocess.run(
            [smi, "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        assert str(os.getpid()) not in listed, f"nvidia-smi lists this process: {listed}"
        detail += ", not among nvidia-smi's compute apps"
    return detail + f" (pid {os.getpid()})"


CHECKS = (
    Check("pool: 1-rank group, pinning and LOCAL_RANK", False, check_pool),
    Check("%%fsdp cell", False, check_cell_magic),
    Check("pulls, calls and probes return CPU values", False, check_pulls_and_probes),
    Check("flight recorder entries", False, check_flight_recorder),
    Check("checkpoint save, async staging, load", False, check_checkpoint),
    Check("FSDP mixed precision and CPU offload, world size 1", False, check_fsdp_variants),
    Check("meta init onto the rank's device", False, check_meta_init),
    Check("hang diagnosis behind an unfinished NCCL collective", True, check_blocked_behind_nccl),
    Check("NCCL watchdog held at a breakpoint", True, check_watchdog_hold),
    Check("bench/gpu.py entry points", False, check_bench_entry_points),
    Check("single-GPU bench figures", True, check_bench_figures),
    Check("pytest -m cuda", True, check_cuda_tests),
    Check("kernel stays CUDA-free", False, check_kernel_cuda_free),
)


def run_checks(ctx: Context, checks: tuple[Check, ...] = CHECKS) -> Iterator[tuple[str, str, str]]:
    """``(status, name, detail)`` of each check, as each one ends."""
    for check in checks:
        if check.needs_gpu and not ctx.gpu:
            yield "SKIP", check.name, "needs a CUDA GPU"
            continue
        began = time.monotonic()
        try:
            detail = check.run(ctx)
        except Exception as error:
            text = str(error).strip() or type(error).__name__
            last = traceback.extract_tb(error.__traceback__)[-1]
            yield "FAIL", check.name, f"{text[:1500]} ({last.name}:{last.lineno})"
        else:
            yield "PASS", check.name, f"{detail} [{time.monotonic() - began:.0f} s]"


def main(argv: list[str] | None = None) -> int:
    from fsdp_interactive.pool import visible_cuda_device_count

    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--device", type=int, default=None, help="CUDA index (default: last)")
    args = parser.parse_args(argv)
    gpus = visible_cuda_device_count()
    ctx = Context(gpu=gpus > 0, device=args.device if args.device is not None else gpus - 1)
    if not ctx.gpu:
        print(
            "make gpu-check needs a CUDA GPU and none is visible here: running the checks "
            "that need none (a dry run on CPU ranks)",
            flush=True,
        )
    ctx.workdir = tempfile.mkdtemp(prefix="fsdpi-gpu-check-")
    failed = 0
    began = time.monotonic()
    try:
        for status, name, detail in run_checks(ctx):
            failed += status == "FAIL"
            print(f"{status}  {name}: {detail}", flush=True)
    finally:
        if ctx.pool is not None:
            ctx.pool.stop()
        shutil.rmtree(ctx.workdir, ignore_errors=True)
    where = f"{gpus} CUDA GPU(s), device {ctx.device}" if ctx.gpu else "no GPU (dry run)"
    print(f"{failed} failed; {where}; {time.monotonic() - began:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    # Run as the module bench.gpu_check, so the ranks import the functions it sends them
    # (functions of __main__ would travel by value, without their module's names).
    from bench import gpu_check

    raise SystemExit(gpu_check.main())
