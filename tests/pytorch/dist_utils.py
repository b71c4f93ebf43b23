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
import time
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


def _launch(ctx, fn, world_size, backend, args, timeout_s):
    """One attempt: (procs, rank error messages, whether rank 0 found its port taken). Polls the error queue
    while the ranks run, so a rendezvous that failed with EADDRINUSE is known before the other ranks time
    out waiting for it."""
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, backend, port, fn, args, errors, timeout_s))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    msgs, port_taken = [], False
    deadline = time.monotonic() + timeout_s + 30
    while time.monotonic() < deadline and not port_taken:
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        alive[0].join(0.2)
        while not errors.empty():
            rank, tb = errors.get()
            msgs.append(f"--- rank {rank} ---\n{tb}")
            port_taken |= "EADDRINUSE" in tb
    for p in procs:
        p.join(0 if port_taken else max(0.0, deadline - time.monotonic()))
    while not errors.empty():
        rank, tb = errors.get()
        msgs.append(f"--- rank {rank} ---\n{tb}")
        port_taken |= "EADDRINUSE" in tb
    return procs, msgs, port_taken


def run_distributed(
    fn, world_size: int = 2, backend: str = "gloo", args: tuple = (), timeout_s: int = 120, attempts: int = 3
):
    """A port is free when picked, but another process of a parallel suite can take it before rank 0's
    store binds it (EADDRINUSE, seen in CI): it is retried on a new port, ``attempts`` launches in all."""
    ctx = mp.get_context("spawn")
    for attempt in range(attempts):
        procs, msgs, port_taken = _launch(ctx, fn, world_size, backend, args, timeout_s)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if port_taken and attempt + 1 < attempts:
            continue
        if hung:
            msgs.append(f"ranks {hung} did not finish within {timeout_s + 30} s")
        bad = [i for i, p in enumerate(procs) if p.exitcode not in (0, None)]
        if msgs or bad:
            codes = [p.exitcode for p in procs]
            raise AssertionError("distributed test failed:\n" + "\n".join(msgs) + f"\nexit codes: {codes}")
        return
