"""Two "nodes" on one host: the multi-node launch path of docs/multinode.md, on gloo, as CI runs it.

Two torchrun agents with ``--nnodes=2 --nproc_per_node=1`` meet through a c10d rendezvous on 127.0.0.1
(node 0 hosts the store, as the first node of a real job does) and train tiny_moe with EP=2 across the two
"nodes": each node holds 2 of the 4 experts, so every MoE layer's all-to-all crosses the node boundary.
The per-rank entry is train.py's own Hydra main (``hydra_main.run``) plus one line that writes each rank's
losses, because train.py logs on rank 0 only. Checks: both agents exit 0, both ranks saw the same loss at
every step, rank 0's JSONL agrees, the loss went down, and a single-node 2-process run of the same job
(launched alongside) has the same losses.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from dist_utils import free_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
pytest.importorskip("megatron.core")
pytest.importorskip("hydra")

STEPS = 4
RANK_ENTRY = textwrap.dedent(
    """
    import json, os, sys
    sys.argv[0] = os.path.join({repo!r}, "train.py")
    import hydra
    from primus_turbo.integrations.hydra_main import RECIPES_DIR, run

    @hydra.main(version_base="1.3", config_path=RECIPES_DIR, config_name="config")
    def main(cfg):
        summary = run(cfg)
        path = os.path.join(os.environ["SIM_OUT"], f"rank{{os.environ['RANK']}}.json")
        with open(path, "w") as f:
            json.dump({{"group_rank": int(os.environ["GROUP_RANK"]), "losses": summary["losses"]}}, f)

    main()
    """
)


def _agent(node_rank: int | None, port: int, entry: str, out_dir: str, metrics: str) -> subprocess.Popen:
    """One "node" (node_rank 0/1) of the 2-node job, or (None) the single-node 2-process reference run."""
    if node_rank is None:
        launch = ["--nproc_per_node=2", f"--master_port={free_port()}"]
    else:
        launch = [
            "--nnodes=2", "--nproc_per_node=1", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=multinode-sim",
            f"--rdzv-conf=is_host={int(node_rank == 0)}", "--local-addr=127.0.0.1",
        ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, entry, "recipe=tiny_moe", "parallel.ep=2",
           f"train.steps={STEPS}", "train.progress=false", f"train.metrics_file={metrics}"]  # fmt: skip
    # conftest sets TRITON_INTERPRET=1 for kernel tests; a training run uses the ops' torch CPU backends.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # CPU path on every machine: the launch path is under test, not the GPU kernels.
    env.update(SIM_OUT=out_dir, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    name = "single_node" if node_rank is None else f"node{node_rank}"
    log = open(os.path.join(out_dir, f"{name}.log"), "w")
    # Own process group: a hung rendezvous is cleaned up with its worker, not just the agent.
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _log(out_dir, node_rank: int | None) -> str:
    name = "single_node" if node_rank is None else f"node{node_rank}"
    with open(os.path.join(out_dir, f"{name}.log")) as f:
        return f.read()[-3000:]


@pytest.mark.slow
def test_two_nodes_on_one_host_train_tiny_moe_with_ep_across_nodes(tmp_path):
    entry = tmp_path / "rank_entry.py"
    entry.write_text(RANK_ENTRY.format(repo=REPO))
    metrics = tmp_path / "metrics.jsonl"
    reference = tmp_path / "single_node.jsonl"
    port = free_port()
    start = time.perf_counter()
    agents = [_agent(node, port, str(entry), str(tmp_path), str(metrics)) for node in (0, 1)]
    # The same job as one node with 2 processes, alongside: the 2-node launch must not change the numbers.
    agents.append(_agent(None, port, os.path.join(REPO, "train.py"), str(tmp_path), str(reference)))
    try:
        codes = [agent.wait(timeout=150) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    seconds = time.perf_counter() - start
    for node, code in zip((0, 1, None), codes):
        assert code == 0, f"node {node} exited {code}:\n{_log(tmp_path, node)}"

    ranks = {}
    for rank in (0, 1):
        ranks[rank] = json.loads((tmp_path / f"rank{rank}.json").read_text())
    assert sorted(r["group_rank"] for r in ranks.values()) == [0, 1], "both ranks ran on the same node"
    losses0, losses1 = ranks[0]["losses"], ranks[1]["losses"]
    assert len(losses0) == STEPS and losses0 == losses1, (losses0, losses1)
    logged = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert logged == pytest.approx(losses0, rel=1e-6), (logged, losses0)
    assert losses0[-1] < losses0[0] - 0.2, f"loss did not go down: {losses0}"
    single = [json.loads(line)["loss"] for line in reference.read_text().splitlines()]
    assert losses0 == pytest.approx(single, rel=1e-5), f"2 nodes {losses0} vs 1 node x 2 procs {single}"
    node0 = _log(tmp_path, 0) + _log(tmp_path, 1)
    assert f"done: {STEPS} steps" in node0
    assert seconds < 120, f"2-node simulation took {seconds:.0f} s (target < 90 s)"


def test_slurm_script_launches_one_agent_per_node_on_one_rendezvous(tmp_path):
    """scripts/slurm/train.sbatch under a fake srun/scontrol (DRY_RUN=1): the per-node torchrun commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho gpu-node-07\necho gpu-node-08\n")
    # Fake srun: drop its options, run the task once per node with that node's SLURM_NODEID.
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
        'for id in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$id "$@"; done\n'
    )
    for tool in ("scontrol", "srun"):
        os.chmod(bin_dir / tool, 0o755)
    slurm = {"SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-node-[07-08]"}
    env = {**os.environ, **slurm, "DRY_RUN": "1", "TORCHRUN": "torchrun"}
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    script = os.path.join(REPO, "scripts", "slurm", "train.sbatch")
    proc = subprocess.run(["bash", script, "parallel.ep=16", "model.num_layers=8"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launches = [line.split() for line in proc.stdout.splitlines() if line.startswith("torchrun ")]
    assert len(launches) == 2, proc.stdout
    for node_rank, args in enumerate(launches):
        assert f"--node-rank={node_rank}" in args
        assert {"--nnodes=2", "--nproc_per_node=8", "--rdzv-backend=c10d", "--rdzv-id=4242"} <= set(args)
        assert "--rdzv-endpoint=gpu-node-07:29500" in args  # the first node hosts the rendezvous
        train = args[args.index("train.py") + 1 :]
        assert train[0] == "recipe=deepseek_moe_fp8"
        assert train[-2:] == ["parallel.ep=16", "model.num_layers=8"]
        assert "resume=true" in train and "train.ckpt_dir=ckpt/4242" in train
