"""Launch a test function in ``world_size`` processes (gloo on CPU, nccl on GPUs).

    def _body(rank, world_size, device, *args): ...        # module-level, picklable
    run_distributed(_body, world_size=2, backend="gloo", args=(...))

A failure in any rank fails the test with that rank's traceback; a hang is cut by ``timeout_s``.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_free_port(make_cmd, attempts: int = 3, **run_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(make_cmd(port), **run_kwargs)`` on a fresh free port. A port is free when picked, but
    another process of a parallel suite can take it before the launcher binds it (EADDRINUSE at the
    rendezvous, seen once in CI): that launch is retried on a new port, up to ``attempts`` times."""
    for _ in range(attempts):
        proc = subprocess.run(make_cmd(free_port()), **run_kwargs)
        out = f"{proc.stdout or ''}{proc.stderr or ''}"
        if proc.returncode == 0 or "EADDRINUSE" not in out:
            return proc
    return proc


def _worker(rank, world_size, backend, port, fn, args, errors, timeout_s):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
        torch.manual_seed(1234 + rank)
        fn(rank, world_size, device, *args)
        dist.barrier()
    except BaseException:  # report every rank's failure to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, backend: str = "gloo", args: tuple = (), timeout_s: int = 120):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, backend, port, fn, args, errors, timeout_s))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s + 30)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    msgs = []
    while not errors.empty():
        rank, tb = errors.get()
        msgs.append(f"--- rank {rank} ---\n{tb}")
    if hung:
        msgs.append(f"ranks {hung} did not finish within {timeout_s + 30} s")
    bad = [i for i, p in enumerate(procs) if p.exitcode not in (0, None)]
    if msgs or bad:
        raise AssertionError(
            "distributed test failed:\n" + "\n".join(msgs) + f"\nexit codes: {[p.exitcode for p in procs]}"
        )
