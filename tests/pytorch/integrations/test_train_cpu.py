"""End-to-end train.py runs through torchrun (the README main-job command), as CI runs them.

Each test launches ``python -m torch.distributed.run --nproc_per_node=N train.py ...`` from the repository
root and checks the exit code and output: the default run trains tiny_moe (EP=2 over gloo) with loss going
down; turbo.enabled=false runs the stock path; a resumed run continues exactly where the saved one stopped;
bad configs stop before any heavy work with a message naming the key.
"""

import json
import math
import os
import re
import sys
import time

import pytest
from dist_utils import run_on_free_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
pytest.importorskip("megatron.core")
pytest.importorskip("hydra")


def torchrun(*overrides, nproc=2, timeout=300, gpu=False):
    def cmd(port):
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={port}", "train.py", *overrides]  # fmt: skip

    start = time.perf_counter()
    # conftest sets TRITON_INTERPRET=1 for kernel tests; a training run uses the ops' torch CPU backends.
    # CUDA_VISIBLE_DEVICES="": these are the CPU main-job checks, also when the suite runs on a GPU machine.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = run_on_free_port(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def _losses(jsonl_path):
    with open(jsonl_path) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def test_default_command_trains_tiny_moe_with_loss_going_down():
    rc, out, seconds = torchrun()
    assert rc == 0, out[-3000:]
    done = re.search(r"done: 20 steps, loss ([\d.]+) -> ([\d.]+)", out)
    assert done, out[-3000:]
    first, last = map(float, done.groups())
    assert last < first - 1.0, f"loss {first} -> {last}: expected a clear decrease"
    for feature in ("gemm", "grouped_gemm", "attention", "rmsnorm", "router", "permute", "dispatch"):
        assert re.search(rf"turbo\.{feature}\s+active", out), feature
    assert "TurboColumnParallelLinear" in out and "tok/s/GPU" in out and "TFLOP/s/GPU" in out
    assert seconds < 180, f"default run took {seconds:.0f} s (target < 180 s on 2 cores)"


def test_turbo_off_runs_the_stock_path_and_turbo_on_matches_it(tmp_path):
    """tiny_dense with TP=2: the stock local modules and the turbo ones train the same trajectory (fp32)."""
    common = ["recipe=tiny_dense", "parallel.tp=2", "train.steps=3"]
    rc, out, _ = torchrun(*common, "turbo.enabled=false", f"train.metrics_file={tmp_path / 'off.jsonl'}")
    assert rc == 0, out[-3000:]
    assert (
        re.search(r"turbo\.gemm\s+off", out)
        and "megatron.core.tensor_parallel.layers.ColumnParallelLinear" in out
    )
    assert "TurboColumnParallelLinear" not in out
    rows = [json.loads(line) for line in (tmp_path / "off.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"step_time_ms", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "max_mem_gb"} <= set(rows[0])
    rc, out, _ = torchrun(*common, f"train.metrics_file={tmp_path / 'on.jsonl'}")
    assert rc == 0, out[-3000:]
    assert "TurboColumnParallelLinear" in out
    off, on = _losses(tmp_path / "off.jsonl"), _losses(tmp_path / "on.jsonl")
    for step in (1, 2, 3):
        assert on[step] == pytest.approx(off[step], rel=1e-4), (off, on)


TINY_MLA = [
    "recipe=deepseek_moe_bf16", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=2", "model.vocab_size=128", "model.seq_length=32", "model.mla.kv_lora_rank=32",
    "model.mla.qk_head_dim=32", "model.mla.qk_pos_emb_head_dim=16", "model.mla.v_head_dim=32",
    "model.moe.num_experts=8", "model.moe.topk=4", "model.moe.num_groups=4", "model.moe.group_topk=2",
    "model.moe.ffn_hidden_size=32", "model.moe.shared_expert_ffn_hidden_size=64", "train.steps=2",
]  # fmt: skip


def test_mla_recipe_runs_with_turbo_off_and_on(tmp_path):
    """MLA (the deepseek recipes; qk 48 / v 32 here) with turbo off needs fix.mla_core_attention: Megatron's
    local DotProductAttention has no k_channels/v_channels. Both paths train and their step-1 losses agree
    (fp32; observed 3e-5 apart)."""
    rc, out, _ = torchrun(*TINY_MLA, "turbo.enabled=false", f"train.metrics_file={tmp_path / 'off.jsonl'}",
                          nproc=1)  # fmt: skip
    assert rc == 0, out[-3000:]
    assert re.search(r"fix\.mla_core_attention\s+active", out), out[-3000:]
    assert "stock_attention.MLADotProductAttention" in out and "TurboCoreAttention" not in out
    rc, out, _ = torchrun(*TINY_MLA, f"train.metrics_file={tmp_path / 'on.jsonl'}", nproc=1)
    assert rc == 0, out[-3000:]
    assert re.search(r"fix\.mla_core_attention\s+n/a", out) and "turbo_layers.TurboCoreAttention" in out
    off, on = _losses(tmp_path / "off.jsonl"), _losses(tmp_path / "on.jsonl")
    assert list(off) == list(on) == [1, 2]
    assert all(math.isfinite(x) for x in (*off.values(), *on.values())), (off, on)
    assert on[1] == pytest.approx(off[1], rel=2e-4), (off, on)


@pytest.mark.parametrize(
    "feature, marker, extra",
    [
        ("dispatch", "TurboLocalTokenDispatcher", ()),
        ("embedding", "F.embedding -> turbo.ops.embedding", ()),
        ("rope", "apply_rotary_pos_emb -> turbo.ops.apply_rotary_pos_emb", ()),
        ("mla_qkv", "MLASelfAttention -> TurboMLASelfAttention", ()),
        ("mla_qkv", "MLASelfAttention -> TurboMLASelfAttention", ("model.mla.q_lora_rank=48",)),
    ],
    ids=["dispatch", "embedding", "rope", "mla_qkv", "mla_qkv-q_lora"],
)
def test_feature_trains_the_same_trajectory_as_the_stock_path(tmp_path, feature, marker, extra):
    """turbo.dispatch at ep=1 (TurboLocalTokenDispatcher: no host sync, no identity re-sort; experts read the
    device counts) vs Megatron's MoEAlltoAllTokenDispatcher, turbo.embedding (the word-embedding gradient
    straight into DDP's main_grad) vs F.embedding + DDP's add, and turbo.rope (MLA's RoPE as one op) vs
    Megatron's eager RoPE, turbo.mla_qkv (MLA's query / key / value from two turbo kernels) vs Megatron's
    split / rope / cat (q projected directly and through q_lora_rank): same losses and gradient norms
    (fp32). This checks the wiring (the flag installs the op and training matches); at init RoPE barely
    moves a 3-step loss, so its numerics are test_rope's."""
    rows = {}
    for flag in ("true", "false"):
        metrics = tmp_path / f"{flag}.jsonl"
        overrides = ("train.steps=3", f"turbo.{feature}={flag}", f"train.metrics_file={metrics}", *extra)
        rc, out, _ = torchrun(*TINY_MLA, *overrides, nproc=1)
        assert rc == 0, out[-3000:]
        assert (marker in out) == (flag == "true"), out[-3000:]
        rows[flag] = [json.loads(line) for line in metrics.read_text().splitlines()]
    for on, off in zip(rows["true"], rows["false"]):
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5), rows
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-4), rows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_megatron_trains_the_same_trajectory_with_turbo_adamw(tmp_path, device):
    """bf16 parameters (fp32 masters in the DistributedOptimizer, casts into the bf16 parameter buffer) and a
    clip that scales every step (max norm 0.05, norms ~0.77): turbo.optimizer on and off give the same losses
    and gradient norms. On CPU the turbo AdamW steps through its torch path (the kernel needs a GPU or the
    interpreter), so this checks the wiring: the clip factor reaches the step and the casts land in the
    parameter buffer (else the weights would not change and step 3's loss would differ). On a GPU the
    Triton kernel steps (fp32 rounding apart from torch's fused AdamW: the losses agree to 1e-3). Adam's
    update barely depends on a gradient scale that is nearly constant over steps, so the factor itself is
    checked by test_megatron_turbo_optimizer (the moments)."""
    import torch

    rows = {}
    for flag in ("true", "false"):
        metrics = tmp_path / f"{flag}.jsonl"
        overrides = ("train.steps=3", "train.dtype=bf16", "train.clip_grad=0.05", f"turbo.optimizer={flag}",
                     f"train.metrics_file={metrics}")  # fmt: skip
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        rc, out, _ = torchrun(*TINY_MLA, *overrides, nproc=1, gpu=device == "cuda")
        assert rc == 0, out[-3000:]
        swapped = "turbo.optim.AdamW for 2 optimizer(s), clip factor in the step, 38 master-to-model cast(s)"
        assert (swapped in out) == (flag == "true"), out[-3000:]
        rows[flag] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows["true"][0]["grad_norm"] > 0.1  # the clip (max 0.05) scales every step
    assert rows["true"][2]["loss"] != rows["true"][0]["loss"]
    rel = 1e-5 if device == "cpu" else 1e-3
    for on, off in zip(rows["true"], rows["false"], strict=True):
        assert on["loss"] == pytest.approx(off["loss"], rel=rel), rows
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=10 * rel), rows


def test_context_parallel_trains_the_same_trajectory_as_one_rank(tmp_path):
    """parallel.cp=2 (ring attention over the zigzag sequence split, Megatron's RoPE slice per CP rank, loss
    and gradients reduced over dp x cp) on the MLA MoE model: the same batches as one rank, so the same losses
    (fp32; observed 1e-7 apart)."""
    rc, out, _ = torchrun(*TINY_MLA, "train.steps=3", f"train.metrics_file={tmp_path / 'cp1.jsonl'}", nproc=1)
    assert rc == 0, out[-3000:]
    cp2 = f"train.metrics_file={tmp_path / 'cp2.jsonl'}"
    rc, out, _ = torchrun(*TINY_MLA, "train.steps=3", "parallel.cp=2", cp2)
    assert rc == 0, out[-3000:]
    assert "ring context parallel x2" in out and re.search(r"op backends in step 1: .*Attention=TORCH", out)
    one, two = _losses(tmp_path / "cp1.jsonl"), _losses(tmp_path / "cp2.jsonl")
    assert list(one) == list(two) == [1, 2, 3]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), (one, two)
    # Adam hides a gradient scale error in the losses; the (unclipped, < 1) gradient norm does not.
    norms = [[json.loads(row)["grad_norm"] for row in open(tmp_path / f)] for f in ("cp1.jsonl", "cp2.jsonl")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5) and max(norms[0]) < 1.0, norms


def test_flex_dispatcher_runs_over_the_turbo_deep_ep_buffer(tmp_path):
    metrics = tmp_path / "flex.jsonl"
    rc, out, _ = torchrun("model.moe.dispatcher=flex", "train.steps=3", f"train.metrics_file={metrics}")
    assert rc == 0, out[-3000:]
    assert "MoEFlexTokenDispatcher (deepep backend) -> primus_turbo.pytorch.deep_ep.Buffer" in out
    losses = _losses(metrics)
    assert list(losses) == [1, 2, 3] and losses[3] < losses[1]


def test_checkpoint_resume_continues_the_same_trajectory(tmp_path):
    """Steps 5 and 6 after a resume from step 3 depend on the Adam moments (step 4 on the weights alone): a
    resume that loaded no optimizer state matched step 4 and drifted from step 5 (4.24 vs 4.40). A resume with
    more train.steps follows this run's schedule."""
    ckpt = tmp_path / "ckpt"
    common = ["train.steps=6", f"train.ckpt_dir={ckpt}", "train.save_interval=3"]
    rc, out, _ = torchrun(*common, f"train.metrics_file={tmp_path / 'full.jsonl'}")
    assert rc == 0, out[-3000:]
    assert (ckpt / "latest").read_text().strip() == "6" and (ckpt / "step_3").is_dir()
    (ckpt / "latest").write_text("3")  # resume from the middle
    rc, out, _ = torchrun(*common, "resume=true", f"train.metrics_file={tmp_path / 'resumed.jsonl'}")
    assert rc == 0, out[-3000:]
    assert "resume: loaded step 3" in out
    full, resumed = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert list(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), (step, full, resumed)
    # resumed with more steps: the learning rate follows the 8-step schedule, not the saved 6-step one
    longer = [f"train.ckpt_dir={ckpt}", "resume=true", "train.steps=8"]
    rc, out, _ = torchrun(*longer, f"train.metrics_file={tmp_path / 'longer.jsonl'}")
    assert rc == 0, out[-3000:]
    rc, out, _ = torchrun("train.steps=8", f"train.metrics_file={tmp_path / 'eight.jsonl'}")
    assert rc == 0, out[-3000:]
    runs = ("longer.jsonl", "eight.jsonl")
    lrs = [{r["step"]: r["lr"] for r in map(json.loads, open(tmp_path / f))} for f in runs]
    assert [lrs[0][s] for s in (7, 8)] == pytest.approx([lrs[1][s] for s in (7, 8)]), lrs
    # only ckpt_dir set: the last step is saved (save_at_end defaults to true)
    rc, out, _ = torchrun("train.steps=2", f"train.ckpt_dir={tmp_path / 'end'}")
    assert rc == 0 and (tmp_path / "end" / "latest").read_text().strip() == "2", out[-3000:]
    # the save line says how long it took and how much it wrote
    assert re.search(r"checkpoint: saved step 2 to \S+ in \d+\.\d s \(\d+\.\d\d GB here\)", out), out[-3000:]


@pytest.mark.parametrize("sync_free", ["true", "false"])
def test_sigterm_stops_after_a_whole_step_and_saves_it(tmp_path, sync_free):
    """SIGTERM in the middle of a run: the loop finishes the step in flight (with turbo.sync_free_step the
    flag travels with the loss and is read one step later, so one more step completes), saves that step, logs
    every step up to it and exits 0. One process started as torchrun would (env://), signalled directly."""
    import signal
    import subprocess

    from dist_utils import free_port

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
    cmd = [sys.executable, "train.py", *TINY_MLA, "train.steps=200", f"train.ckpt_dir={ckpt}",
           f"train.metrics_file={metrics}", f"turbo.sync_free_step={sync_free}",
           "train.progress=false"]  # fmt: skip
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=pipe, stderr=subprocess.STDOUT, text=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("step 3/"):
                proc.send_signal(signal.SIGTERM)
                break
        out.extend(proc.stdout)
        rc = proc.wait(timeout=240)
    finally:
        proc.kill()
    text = "".join(out)
    assert rc == 0, text[-3000:]
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", text)
    assert stopped, text[-3000:]
    last = int(stopped.group(1))
    assert 3 <= last < 200
    assert (ckpt / "latest").read_text().strip() == str(last) and (ckpt / f"step_{last}").is_dir()
    assert list(_losses(metrics)) == list(range(1, last + 1))  # every step logged, the deferred last one too


def test_unavailable_turbo_feature_under_strict_stops_with_the_flag():
    # async-TP serves bf16 linears; under precision=fp8 the turbo linears run the FP8 GEMMs instead
    rc, out, _ = torchrun("recipe=tiny_dense", "parallel.tp=2", "parallel.sequence_parallel=true",
                          "precision=fp8", "fp8.emulate=true", "turbo.async_tp=true",
                          "train.steps=2")  # fmt: skip
    assert rc != 0
    assert "turbo.async_tp cannot serve this run" in out and "turbo.strict=false" in out
    assert "async-TP serves bf16 linears" in out
    assert "step 1/" not in out


def test_async_tp_linears_train_like_the_unfused_ones(tmp_path):
    """tiny_dense, TP=2 + sequence parallel: turbo.async_tp fuses the linears' all-gather / reduce-scatter
    into their GEMMs (on gloo the fused ops run their NCCL-unfused backend): same losses, with the weight
    gradients going through main_grad in both runs."""
    common = ["recipe=tiny_dense", "parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=3"]
    losses = {}
    for flag in ("false", "true"):
        metrics = tmp_path / f"{flag}.jsonl"
        rc, out, _ = torchrun(*common, f"turbo.async_tp={flag}", f"train.metrics_file={metrics}")
        assert rc == 0, out[-3000:]
        state = "active" if flag == "true" else "off"
        assert re.search(rf"turbo\.async_tp\s+{state}", out), out[-3000:]
        losses[flag] = _losses(metrics)
    for step in (1, 2, 3):
        assert losses["true"][step] == pytest.approx(losses["false"][step], rel=1e-4), losses


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision=fp8"], "or fp8.emulate=true for FP8 numerics on the CPU"),
        (["precision=fp8", "fp8.emulate=true", "turbo.enabled=false"], "runs the turbo FP8 ops"),
        (["fp8.emulate=maybe"], "fp8.emulate='maybe': expected true or false"),
        (["fp8.wgrad=fp16"], "fp8.wgrad='fp16': expected one of ('bf16', 'fp8')"),
        (["fp8.format=e5m2"], "fp8.format='e5m2': expected one of ('auto', 'hybrid', 'e4m3')"),
        (["train.autograd_threads=maybe"], "train.autograd_threads='maybe': expected true or false"),
        (["train.gc_interval=-1"], "train.gc_interval=-1: expected an integer >= 0"),
        (["parallel.ep=3"], "does not divide world size 2"),
        (["recipe=no_such_recipe"], "Could not find 'recipe/no_such_recipe'"),
    ],
)
def test_bad_config_fails_before_heavy_work(overrides, message):
    rc, out, seconds = torchrun(*overrides)
    assert rc != 0 and message in out, out[-3000:]
    assert "turbo report" not in out  # stopped before process groups / model build


def test_emulated_fp8_trains_like_bf16_on_cpu(tmp_path):
    """fp8.emulate=true: the turbo FP8 ops' TORCH backends (real E4M3/E5M2 rounding and scales) on the CPU.
    Rowwise FP8 (the default recipe) must track bf16 on the same seed and data: a wrong scale, a lost
    gradient or a stale cached weight shows up as a gap of tens of percent within these 120 steps. The
    bound (15%) sits above what this tiny run varies by: -1.4% (session 4), -7.6% (session 5, both with FP8
    weight gradients), +6.5% / +10.7% (session 8, bf16 weight gradients, foreach / fused AdamW). The 120 KB
    sample is memorized by step ~100 and that regime amplifies rounding: the AdamW switch, a rounding-level
    change that moved the bf16 run by 0.01%, moved the FP8 run by 4 points."""
    common = ["parallel.ep=1", "train.steps=120", "train.progress=false"]
    losses = {}
    for name, extra in (("bf16", []), ("fp8", ["precision=fp8", "fp8.emulate=true"])):
        metrics = tmp_path / f"{name}.jsonl"
        rc, out, _ = torchrun(*common, *extra, f"train.metrics_file={metrics}", nproc=1, timeout=600)
        assert rc == 0, out[-3000:]
        losses[name] = _losses(metrics)
    assert "GemmFP8=TORCH" in out and "GroupedGemmFP8=TORCH" in out, out[-3000:]
    final = {k: sum(v[s] for s in range(101, 121)) / 20 for k, v in losses.items()}
    assert final["fp8"] < losses["fp8"][1] - 1.0, final  # it learned
    assert abs(final["fp8"] / final["bf16"] - 1) < 0.15, final


@pytest.mark.parametrize(
    "key, reference, choice, report",
    [("fp8.wgrad", "fp8", "bf16", "HYBRID ROWWISE current scaling; weight gradients in bf16"),
     ("fp8.format", "hybrid", "e4m3", "E4M3 ROWWISE current scaling")],
    ids=["wgrad_bf16", "format_e4m3"],
)  # fmt: skip
def test_emulated_fp8_backward_options_on_cpu(tmp_path, key, reference, choice, report):
    """fp8.wgrad=bf16 (weight gradients from the saved bf16 inputs) and fp8.format=e4m3 (E4M3 gradients where
    HYBRID has E5M2): the turbo report names the choice, the step-1 forward is the same, the weights then
    differ (step 1's learning rate is 0 in warm-up, so step 3 is the first loss to see it)."""
    common = ["parallel.ep=1", "train.steps=3", "train.progress=false", "precision=fp8", "fp8.emulate=true"]
    losses, outs = {}, {}
    for value in (reference, choice):
        metrics = tmp_path / f"{value}.jsonl"
        rc, outs[value], _ = torchrun(*common, f"{key}={value}", f"train.metrics_file={metrics}", nproc=1)
        assert rc == 0, outs[value][-3000:]
        losses[value] = _losses(metrics)
    assert report in outs[choice] and report not in outs[reference], outs[choice][-3000:]
    assert "HYBRID ROWWISE" in outs[reference], outs[reference][-3000:]  # fp8.format=auto with rowwise
    assert losses[choice][1] == losses[reference][1], losses
    assert losses[choice][3] != losses[reference][3], losses


def test_megatron_torch_adam_fallback_is_switched_to_fused_adam():
    # Without TE/Apex, Megatron steps with torch's foreach Adam(W), which reads each parameter's step counter
    # with .item() (a host sync per parameter on a GPU): the trainer switches it to fused Adam(W), same math.
    from types import SimpleNamespace

    import torch
    from primus_turbo.integrations.megatron.trainer import use_fused_adam

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, weight_decay=0.1)
    groups = [{"params": ref[:2]}, {"params": ref[2:]}]
    ref_opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)  # not Adam: left alone
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=o) for o in (opt, sgd)])
    assert use_fused_adam(chained) == 2
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    assert not sgd.param_groups[0].get("fused")
    for _ in range(3):
        for p, r in zip(params, ref):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    # an optimizer that has stepped keeps its implementation (its state was made by the other path)
    assert use_fused_adam(SimpleNamespace(optimizer=ref_opt)) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_megatron_sync_free_step_trains_the_same_trajectory_as_the_synced_loop(tmp_path, device):
    """turbo.sync_free_step (grad norm and clip on the device, metrics read back one step later) against the
    synced loop, with a clip that scales every step: the same losses and gradient norms, every step logged
    (the last one by the flush), with turbo.optimizer on (the factor goes into the turbo AdamW step) and off
    (the device factor multiplies the gradients, against the synced loop with Megatron's clip). The
    turbo.optimizer runs also collect garbage manually (train.gc_interval=2), which changes no number."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rows = {}
    for sync_free, optimizer in (("false", "true"), ("true", "true"), ("false", "false"), ("true", "false")):
        metrics = tmp_path / f"{sync_free}_{optimizer}.jsonl"
        overrides = ("train.steps=3", "train.dtype=bf16", "train.clip_grad=0.05",
                     f"turbo.optimizer={optimizer}", f"turbo.sync_free_step={sync_free}",
                     f"train.metrics_file={metrics}",
                     f"train.gc_interval={2 if optimizer == 'true' else 0}")  # fmt: skip
        rc, out, _ = torchrun(*TINY_MLA, *overrides, nproc=1, gpu=device == "cuda")
        assert rc == 0, out[-3000:]
        active = re.search(r"turbo\.sync_free_step\s+active", out) is not None
        assert active == (sync_free == "true"), out[-3000:]
        rows[sync_free, optimizer] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows["true", "true"]] == [1, 2, 3]
    assert rows["true", "true"][0]["grad_norm"] > 0.1  # the clip (max 0.05) scales every step
    rel = 1e-5 if device == "cpu" else 1e-4
    for optimizer in ("true", "false"):
        for on, off in zip(rows["true", optimizer], rows["false", optimizer], strict=True):
            assert on["loss"] == pytest.approx(off["loss"], rel=rel), rows
            assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=rel), rows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grad_norm_fix_matches_megatron_fallback_without_host_syncs(device):
    # fix.grad_norm_no_sync: Megatron's TE/Apex-less l2 norm built torch.tensor() from one CUDA norm per
    # gradient (a host sync per parameter and step); the replacement keeps the norm on the device.
    import torch
    from megatron.core import utils
    from primus_turbo.integrations.megatron.patches import _l2_norm_on_device, _scale_foreach

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    grads = [torch.randn(5, 7, device=device), torch.randn(3, device=device), torch.randn(0, device=device),
             torch.randn(64, 1024, device=device)]  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = _l2_norm_on_device(2048 * 32, None, [grads], False)
        src, dst = [g.clone() for g in grads], [torch.empty_like(g) for g in grads]
        _scale_foreach(2048 * 32, None, [src, dst], 0.5)
        _scale_foreach(2048 * 32, None, [src, src], 2.0)  # in place (clip_grads passes [grads, grads])
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert norm.shape == (1,) and norm.dtype == torch.float32 and norm.device == grads[0].device
    ref = torch.stack([g.double().norm() for g in grads]).norm()
    torch.testing.assert_close(norm[0].double(), ref, rtol=1e-6, atol=0)
    want = [torch.empty_like(g) for g in grads]
    utils.local_multi_tensor_scale(2048 * 32, None, [grads, want], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(dst, want))
    assert all(torch.equal(a, g * 2.0) for a, g in zip(src, grads))
