"""`moe-jax compile` (moe_jax/compile/), target parsing (moe_jax/compile/targets.py) and the
chip table (moe_jax/hardware.py), and `train`'s up-front memory check.

The TPU compiles run in a subprocess (the compiler pins JAX to describe, never open, the
TPU) with the libtpu that `make compilers` installs (`make test` installs it first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from moe_jax import cli, hardware
from moe_jax.commands import compile as compile_command
from moe_jax.compile import collectives, hlo_costs, step_analysis, targets
from moe_jax.compile import report as compile_report

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import moe_compiled  # noqa: E402  (benchmarks/ is not a package)

SMOKE = [
    "--gin_file=runs/smoke_cpu.gin",
    "--no_eval",
]  # the train step only; one test compiles both


def compile_cli(tmp_path, *flags: str) -> tuple[int, str, dict | None]:
    """(exit code, stdout + stderr, JSON report) of `moe-jax compile` in a fresh process."""
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # the test session's 8 forced CPU devices are not the target's
    proc = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "compile", *flags, f"--out={out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    report = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, report


def test_parse_target_and_chip_table():
    v5e = targets.parse_target("tpu:v5e:4x4")
    assert (v5e.platform, v5e.chip.name, v5e.num_chips) == ("tpu", "v5e", 16)
    assert v5e.chip.hbm_bytes == 16 * hardware.GiB
    assert targets.parse_target("gpu:h100:8").num_chips == 8
    assert targets.parse_target("cpu:8").chip is None
    # Cloud TPU accelerator types: TensorCores for v4/v5p (2 per chip), chips for v5e/v6e;
    # v4 chips show as two devices to libtpu, so half the chips give the slice's device count
    for accelerator, (chip, topology) in {
        "v5p-32": ("v5p", "2x2x4"),
        "v5p-128": ("v5p", "4x4x4"),
        "v5litepod-16": ("v5e", "4x4"),
        "v6e-8": ("v6e", "2x4"),
        "v4-32": ("v4", "2x2x2"),
    }.items():
        target = targets.parse_target(f"tpu:{accelerator}")
        assert (target.chip.name, target.topology) == (chip, topology), accelerator
    for bad, named in [
        ("tpu:v9:2x2", "v9"),
        ("gpu:h100:2x2", "2x2"),
        ("tpu:v5e", "PLATFORM:CHIP"),
        ("tpu:h100:2x2", "h100"),
        ("cpu:0", "PLATFORM"),
        ("tpu:v5p-6", "tpu:v5p:TOPOLOGY"),
    ]:
        with pytest.raises(targets.TargetError, match=named) as err:
            targets.parse_target(bad)
        assert "tpu:v5e:4x4" in str(err.value) and "gpu:h100:8" in str(err.value)  # known ones
    # a single chip, a 3-D v5e, sides that are not powers of two: refused with the chip's valid list
    for bad in (
        "tpu:v5e:1x1",
        "tpu:v5e:2x2x2",
        "tpu:v6e:3x4",
        "tpu:v5p:2x2",
        "tpu:v4:1x1x1",
        "tpu:v5litepod-1",
    ):
        chip = "v5e" if "litepod" in bad else bad.split(":")[1]
        with pytest.raises(targets.TargetError) as err:
            targets.parse_target(bad)
        assert all(t in str(err.value) for t in targets.TPU_TOPOLOGIES[chip]), str(err.value)
    # every listed topology is accepted, and so is what a Cloud TPU name maps to
    for chip, topologies in targets.TPU_TOPOLOGIES.items():
        for topology in topologies:
            assert targets.parse_target(f"tpu:{chip}:{topology}").topology == topology
    # device kinds: the longest prefix wins (v5e shows as "TPU v5 lite", v5p as "TPU v5")
    assert hardware.chip_of_device_kind("TPU v5 lite").name == "v5e"
    assert hardware.chip_of_device_kind("TPU v5").name == "v5p"
    assert hardware.chip_of_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware.chip_of_device_kind("cpu") is None

    class Core:  # libtpu describes a v4 chip as two TensorCore devices
        device_kind = "TPU v4"

    facts = hardware.device_facts([Core()] * 16, hardware.CHIPS["v4"], num_chips=8)
    assert facts.hbm_bytes == 16 * hardware.GiB and facts.peak_flops == 275e12 / 2


def test_bad_target_mesh_and_missing_compiler_are_one_line(tmp_path, monkeypatch, capsys):
    assert compile_command.main(["--target=tpu:v7x:2x2", *SMOKE]) == 1
    assert "v7x" in capsys.readouterr().err
    assert (
        compile_command.main(["--target=cpu:4", *SMOKE, "--gin.make_mesh.mesh_shape=(1,3,1)"]) == 1
    )
    err = capsys.readouterr().err
    assert "mesh_shape=(1, 3, 1)" in err and "4" in err and "Traceback" not in err
    monkeypatch.setenv("MOE_JAX_COMPILERS", str(tmp_path))  # nothing installed there
    assert compile_command.main(["--target=gpu:h100:8", *SMOKE]) == 1
    assert "compile-gpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    "mesh,with_eval", [pytest.param("(1,4,1)", False, marks=pytest.mark.slow), ("(2,2,1)", True)]
)
def test_tpu_compile_of_the_smoke_config(tmp_path, mesh, with_eval):
    flags = SMOKE if not with_eval else [f for f in SMOKE if f != "--no_eval"]
    code, output, report = compile_cli(
        tmp_path,
        "--target=tpu:v5e:2x2",
        *flags,
        f"--gin.make_mesh.mesh_shape={mesh}",
        f"--hlo_dir={tmp_path}",
    )
    assert code == 0, output
    step = report["steps"]["train"]
    # the counts are those of the kept HLO (the TPU's async forms: -start/-done pairs once)
    hlo = (tmp_path / "train.hlo.txt").read_text()
    assert step["collectives"] == collectives.collective_totals(hlo_costs.parse(hlo))
    assert "all-to-all" in hlo
    # the experts' loop (per_expert_loop below) runs its body once per expert of a device
    # (two over (2,2,1); over (1,4,1) one, and XLA drops the loop): the report's per-step
    # work counts it so
    per_step, ops = step["per_step"], hlo_costs.parse(hlo)
    looped = any(op.trips > 1 for op in ops)
    assert per_step["looped"] == looped == (mesh == "(2,2,1)") and per_step["cycles"] > 0
    once = sum(op.flops for op in ops)
    assert per_step["flops"] == hlo_costs.summary(ops)["flops"]
    assert per_step["flops"] > once if looped else per_step["flops"] == once
    assert "HLO text per device and step:" in output
    assert ("once per trip" in output) == looped
    parts = per_step["bytes_by_part"]
    assert {"encoder self_attention", "encoder ffn", "outside the model"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(per_step["bytes"])
    assert "its device memory by part: " in output
    assert (tmp_path / "eval.hlo.txt").exists() == with_eval == ("eval" in report["steps"])
    if with_eval:  # the eval step: forward only, no optimizer state
        evaluation = report["steps"]["eval"]
        assert evaluation["fits"] and evaluation["flops_per_step"] == pytest.approx(
            step["flops_per_step"] / 3
        )
        assert evaluation["bytes"]["params_and_optimizer"] < step["bytes"]["params_and_optimizer"]
    moe = step["moe_layers"]  # the MoE layers' share of the step's operations
    assert 0 < moe["indexed_bytes"] < moe["hlo_bytes"] < moe["step_hlo_bytes"] and moe["flops"] > 0
    assert "MoE layers:" in output
    assert report["devices"] == 4 and report["device_kind"].startswith("TPU v5")
    # float32 activations over data and expert axes: the batched expert matmuls made libtpu
    # 0.0.42 abort (ReshapeIsBitcast) over (2,2,1); on TPU float32 runs one matmul per expert
    assert report["moe_layer"] == {
        "platform": "tpu",
        "dispatch": "sort",
        "per_expert_loop": True,
        "implementation": "sort",
        "choice_major_combine": True,
        "exchange": "all_to_all",  # the mesh's expert axis
        "grouped_matmul": False,
        "gather_gradients": False,
        "scatter_rows": True,
        "gather_in_kernel": False,
    }
    assert step["collectives"]["all-to-all"]["count"] >= 2  # experts over the expert axis
    # bound from the shapes: the whole Adam state (params + 2 moments, fp32) twice, plus
    # per device a quarter of the batch's [tokens, vocab + 100 x d_ff] fp32 activations
    dims = report["model_dims"]
    tokens = report["batch_size"] * sum(report["task_feature_lengths"].values())
    bound = 2 * 3 * 4 * report["parameters"] + 4 * tokens / 4 * (
        dims["vocab_size"] + 100 * dims["mlp_dim"]
    )
    assert 0 < step["bytes"]["params_and_optimizer"] < step["bytes"]["total"] < bound
    assert step["bytes"]["device_memory"] == 16 * hardware.GiB and step["fits"]
    assert "verdict: fits" in output
    # libtpu's start-up output (worker hostnames, host bounds, "Logging before InitGoogle") is
    # hidden
    assert not re.search(
        r"^(E|W)0000|TPU_WORKER_HOSTNAMES|host bounds|InitGoogle", output, re.MULTILINE
    ), output


def test_tpu_compile_refuses_a_run_too_big_for_the_chip(tmp_path):
    """(--verbose: the compiler's own output passes through; the report is the same.)"""
    code, output, report = compile_cli(
        tmp_path,
        "--target=tpu:v5e:2x2",
        *SMOKE,
        "--verbose",
        "--gin.make_mesh.mesh_shape=(1,4,1)",
        "--gin.BATCH_SIZE=131072",
    )
    assert code == 1, output
    assert re.search(r"TPU_WORKER_HOSTNAMES|host bounds|InitGoogle", output), output
    assert not report["fits"] and report["steps"]["train"]["bytes"]["total"] > 16 * hardware.GiB
    assert "DOES NOT FIT" in output and "--gin.BATCH_SIZE=65536" in output
    assert "--gin.SCAN_LAYERS=True --gin.REMAT_POLICY=minimal" in output  # the smoke's unrolled


def test_train_refuses_a_step_bigger_than_the_machine(tmp_path, capsys, monkeypatch):
    def no_hlo_text(*args, **kwargs):
        raise AssertionError("a run's fit check read the HLO text")

    # the check reads the compiled step's memory only: the HLO text is `moe-jax compile`'s
    monkeypatch.setattr(step_analysis, "hlo_analysis", no_hlo_text)
    code = cli.main(
        [
            "train",
            "--gin_file=runs/smoke_cpu.gin",
            f"--gin.MODEL_DIR={tmp_path}",
            "--gin.BATCH_SIZE=131072",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "available memory" in err and "--gin.BATCH_SIZE=65536" in err
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was written


def test_compiler_options_follow_the_platform():
    # GPU steps compile without Triton GEMMs (XLA 0.10.2 aborts tiling Base's attention dots);
    # CPU and TPU steps compile with XLA's defaults
    assert (
        hardware.compiler_options("cuda")
        == hardware.compiler_options("gpu")
        == {"xla_gpu_enable_triton_gemm": False}
    )
    assert hardware.compiler_options("cpu") == hardware.compiler_options("tpu") == {}


def test_collectives_of_a_compiled_program_match_its_shapes():
    """An all-to-all, a psum, an all-gather and a psum-scatter compiled over 4 CPU devices:
    each counted once, with the bytes moved per device that collectives defines (operands; the
    result for the all-gather), in `moe-jax compile`'s report as in the benchmark's table."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def step(a, b, c, d):
        return (
            jax.lax.all_to_all(a, "x", 0, 0, tiled=True),
            jax.lax.psum(b, "x"),
            jax.lax.all_gather(c, "x", tiled=True),
            jax.lax.psum_scatter(d, "x", tiled=True),
        )

    shapes = [(4 * 8, 16, np.float32), (4 * 3, 5, jax.numpy.bfloat16)]
    shapes += [(4 * 2, 6, np.float32), (4 * 16, 3, np.float32)]
    args = [jax.ShapeDtypeStruct((rows, cols), dtype) for rows, cols, dtype in shapes]
    sharded = jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    compiled = jax.jit(sharded).lower(*args).compile()
    facts = hardware.device_facts([None] * 4, hardware.CHIPS["h100"], 4)
    report = step_analysis.analyze(
        compiled, facts, state_bytes=0, flops_per_step=1e9, tokens_per_step=1, num_devices=4
    )
    found = report["collectives"]
    assert found["all-to-all"] == {"count": 1, "bytes": 8 * 16 * 4}  # per device: [8, 16]
    assert found["all-reduce"]["count"] == 1 and found["all-reduce"]["bytes"] in (
        3 * 5 * 2,
        3 * 5 * 4,  # XLA:CPU reduces bfloat16 in float32
    )
    assert found["all-gather"] == {"count": 1, "bytes": 4 * 2 * 6 * 4}  # the gathered [8, 6]
    assert found["reduce-scatter"] == {"count": 1, "bytes": 16 * 3 * 4}  # the whole [16, 3]
    assert report["estimate"]["collectives_s"] == pytest.approx(
        sum(c["bytes"] for c in found.values()) / facts.interconnect_bandwidth
    )
    # the benchmark's all-to-all columns read the same executable the same way
    traffic = moe_compiled.all_to_all_traffic(hlo_costs.parse(compiled.as_text()))
    assert {"count": traffic["count"], "bytes": traffic["bytes"]} == found["all-to-all"]


def test_collectives_counts_an_async_pair_once_and_reads_past_tuple_comments():
    """The same collective written sync, as an async -start/-done pair (whose start tuple
    holds operands and, for collective-permute, u32 sync flags), as XLA:GPU's async-start
    wrapping it, as XLA:TPU's chain of fusions (start, continuation, done: each holds the
    all-gather with the chain's chain_id) or with XLA's /*index=5*/ comments in a long
    tuple: the same count and bytes; a loop holding a collective is no collective itself."""

    def totals(*lines: str, called: str = "") -> dict:
        """The totals of ``lines`` in an entry computation after ``called`` computations."""
        params = (
            "  %p = f32[8,128]{1,0} parameter(0)\n  %w = bf16[48,12]{1,0} parameter(1)\n"
            "  %g = f32[2,128]{1,0} parameter(2)\n"
        )
        entry = "ENTRY %main {\n" + params + "".join(lines) + "}\n"
        return collectives.collective_totals(hlo_costs.parse(called + entry))

    sync = "  %a = f32[8,128]{1,0} all-to-all(%p), dimensions={0}\n"
    pair = [
        "  %s = ((f32[8,128]{1,0}), f32[8,128]{1,0}) all-to-all-start(%p), dimensions={0}\n",
        "  ROOT %d = f32[8,128]{1,0} all-to-all-done(%s)\n",
    ]
    assert totals(*pair) == totals(sync) == {"all-to-all": {"count": 1, "bytes": 4 * 8 * 128}}
    permute = "  %c = bf16[48,12]{1,0} collective-permute(%w), source_target_pairs={{0,1},{1,0}}\n"
    permute_pair = [
        "  %cps = (bf16[48,12]{1,0}, bf16[48,12]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) "
        "collective-permute-start(%w), source_target_pairs={{0,1},{1,0}}\n",
        "  %cpd = bf16[48,12]{1,0} collective-permute-done(%cps)\n",
    ]
    assert (
        totals(*permute_pair)
        == totals(permute)
        == {"collective-permute": {"count": 1, "bytes": 2 * 48 * 12}}
    )
    gather = "  %ag = f32[8,128]{1,0} all-gather(%g), dimensions={0}\n"
    wrapped = (
        "%wrapped {\n  %q = f32[2,128]{1,0} parameter(0)\n"
        "  ROOT %i = f32[8,128]{1,0} all-gather(%q), dimensions={0}\n}\n"
    )
    async_gather = [
        "  %as = ((f32[2,128]{1,0}), f32[8,128]{1,0}, s32[]) async-start(%g), calls=%wrapped\n",
        "  %ad = f32[8,128]{1,0} async-done(%as)\n",
    ]
    gathered = {"all-gather": {"count": 1, "bytes": 4 * 8 * 128}}  # the result
    assert totals(gather) == totals(*async_gather, called=wrapped) == gathered
    piece = (
        "%{0} {{\n  %q = f32[2,128]{{1,0}} parameter(0)\n  ROOT %i = f32[8,128]{{1,0}} "
        'all-gather(%q), channel_id=7, dimensions={{0}}, frontend_attributes={{chain_id="3"}}\n}}\n'
    )
    chain = [
        "  %c0 = (f32[2,128]{1,0}, f32[8,128]{1,0}, u32[]{:S(2)}) fusion(%g), calls=%start\n",
        "  %mm = f32[2,2]{1,0} dot(%g, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}\n",
        "  %c1 = (f32[2,128]{1,0}, f32[8,128]{1,0}, u32[]{:S(2)}) fusion(%c0), calls=%more\n",
        "  %c2 = f32[8,128]{1,0} fusion(%c1), calls=%done\n",
    ]
    fused = "".join(piece.format(name) for name in ("start", "more", "done"))
    assert totals(*chain, called=fused) == gathered
    ops = hlo_costs.parse(
        fused + "ENTRY %main {\n  %g = f32[2,128]{1,0} parameter(0)\n" + "".join(chain) + "}\n"
    )
    assert [c.overlapped_ops for c in collectives.collectives(ops)] == [1]  # the dot
    shapes = ["f32[32]{0}"] * 5 + ["f32[32,4]{0,1}"]
    operands = "".join(f"  %o{i} = {t} parameter({i})\n" for i, t in enumerate(shapes))
    plain = (
        f"  %r = ({', '.join(shapes)}) all-reduce(%o0, %o1, %o2, %o3, %o4, %o5), to_apply=%add\n"
    )
    commented = plain.replace(", %o5", ", /*index=5*/%o5")
    reduced = {"all-reduce": {"count": 1, "bytes": 4 * (5 * 32 + 128)}}
    assert totals(operands, commented) == totals(operands, plain) == reduced
    loop = (
        "%body {\n  %t = f32[8,128]{1,0} parameter(0)\n"
        "  ROOT %b = f32[8,128]{1,0} all-to-all(%t), dimensions={0}\n}\n"
        "%cond {\n  %t = f32[8,128]{1,0} parameter(0)\n  ROOT %k = pred[] constant(true)\n}\n"
    )
    while_line = "  %l = f32[8,128]{1,0} while(%p), condition=%cond, body=%body\n"
    assert totals(while_line, called=loop) == totals(sync)  # the body's, not the loop's too


def test_gemm_custom_calls_count_their_flops():
    """A cuBLAS GEMM (how XLA:GPU writes a dot; its dimensions in backend_config) counts as
    the dot it replaces: 2 x result elements x contracted size."""
    dot = (
        "ENTRY %main {\n  %a = bf16[128,32]{1,0} parameter(0)\n  %b = bf16[32,96]{1,0} "
        "parameter(1)\n"
        "  ROOT %d = bf16[128,96]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}\n}\n"
    )
    gemm = dot.replace(
        "ROOT %d = bf16[128,96]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}",
        "ROOT %d = (bf16[128,96]{1,0}, s8[4194304]{0}) custom-call(%a, %b), "
        'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":'
        '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}',
    )
    flops = [hlo_costs.summary(hlo_costs.parse(text))["flops"] for text in (dot, gemm)]
    assert flops[0] == flops[1] == 2 * 128 * 96 * 32


def test_a_loop_body_counts_once_per_trip_and_the_loop_moves_nothing_itself():
    """The same stack of matmuls scanned (a while loop with a known trip count) and unrolled:
    the same FLOPs per run (summary and by operand type), each body op runs trip-count
    times, the loop instruction itself moves no bytes (its state is its body's), and nested
    loops multiply their trip counts."""
    import jax
    import jax.numpy as jnp

    def scanned(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    def unrolled(x, w):
        for i in range(w.shape[0]):
            x = jnp.tanh(x @ w[i])
        return x

    x, w = jnp.ones((8, 16)), jnp.ones((5, 16, 16))
    texts = [jax.jit(f).lower(x, w).compile().as_text() for f in (scanned, unrolled)]
    flops = 5 * 2 * 8 * 16 * 16
    for text in texts:
        assert hlo_costs.summary(hlo_costs.parse(text))["flops"] == flops
        assert hlo_costs.matmul_flops_by_type(text) == {"f32": flops}
    ops = hlo_costs.parse(texts[0])
    assert {op.trips for op in ops if op.flops} == {5}
    assert [op.bytes for op in ops if op.opcode == "while"] == [0.0]

    def loop(name: str, body_lines: str, trips: int | None) -> str:
        config = f', backend_config={{"known_trip_count":{{"n":"{trips}"}}}}' if trips else ""
        return (
            f"%{name}_cond {{\n  %t = f32[8,8]{{1,0}} parameter(0)\n"
            f"  ROOT %k = pred[] constant(true)\n}}\n"
            f"%{name}_body {{\n  %t = f32[8,8]{{1,0}} parameter(0)\n{body_lines}}}\n",
            f"while(%t), condition=%{name}_cond, body=%{name}_body{config}\n",
        )

    dot = (
        "  ROOT %d = f32[8,8]{1,0} dot(%t, %t), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}\n"
    )

    def nested(outer: int | None, inner: int | None) -> float:
        inner_text, inner_call = loop("inner", dot, inner)
        outer_text, outer_call = loop("outer", f"  ROOT %l = f32[8,8]{{1,0}} {inner_call}", outer)
        entry = (
            "ENTRY %main {\n  %t = f32[8,8]{1,0} parameter(0)\n"
            f"  ROOT %l = f32[8,8]{{1,0}} {outer_call}}}\n"
        )
        return hlo_costs.summary(hlo_costs.parse(inner_text + outer_text + entry))["flops"]

    assert nested(3, 4) == 12 * 2 * 8 * 8 * 8
    assert nested(None, 4) == 4 * 2 * 8 * 8 * 8  # an unknown trip count counts once


def test_a_loop_without_a_known_trip_count_is_counted_from_its_condition_and_step():
    """XLA:TPU prints no known_trip_count: the trip count is read from the loop itself, a
    condition ``counter < limit`` on an element of the state, the counter's initial value
    in the caller's state tuple and its step in the body (XLA:TPU's windowed einsum loops
    count 0, 2, 4, 6 below 8: 4 trips, each with its share of the matmul; the counter may
    pass through a copy before its step is added)."""

    def module(start: int, step: int, limit: int, copied: bool = False) -> str:
        counter = "%c" if copied else "%i"
        return (
            "%cond {\n  %s = (u32[], f32[8,8]) parameter(0)\n"
            "  %i = u32[] get-tuple-element(%s), index=0\n"
            f"  %n = u32[] constant({limit})\n"
            "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}\n"
            "%body {\n  %s = (u32[], f32[8,8]) parameter(0)\n"
            "  %i = u32[] get-tuple-element(%s), index=0\n"
            "  %x = f32[8,8]{1,0} get-tuple-element(%s), index=1\n"
            "  %c = u32[] copy(%i)\n"
            f"  %k = u32[] constant({step})\n  %next = u32[] add({counter}, %k)\n"
            "  %d = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, "
            "rhs_contracting_dims={0}\n"
            "  ROOT %t = (u32[], f32[8,8]) tuple(%next, %d)\n}\n"
            "ENTRY %main {\n  %x = f32[8,8]{1,0} parameter(0)\n"
            f"  %zero = u32[] constant({start})\n"
            "  %init = (u32[], f32[8,8]) tuple(%zero, %x)\n"
            "  ROOT %l = (u32[], f32[8,8]) while(%init), condition=%cond, body=%body\n}\n"
        )

    def trips(*args: int, copied: bool = False) -> set[int]:
        return {op.trips for op in hlo_costs.parse(module(*args, copied=copied)) if op.flops}

    assert trips(0, 2, 8) == trips(0, 2, 8, copied=True) == {4}
    assert trips(0, 1, 12) == {12}
    assert trips(3, 1, 12) == {9}
    assert trips(0, 3, 8) == {3}  # 0, 3, 6


def test_bytes_are_told_by_the_part_of_the_model_forward_and_backward_alike():
    """An op's part is its layer block (unrolled, scanned or rematerialised alike), else the
    module names below the model's method, else outside the model (loss, optimizer); the
    totals weigh each op by its trips, largest first."""
    sources = {
        "jit(train_step)/jvp(EncoderDecoder)/EncoderDecoder.encode/encoder/layers_3/"
        "self_attention/attention/bqhd,bkhd->bhqk/dot_general": "encoder self_attention",
        "jit(train_step)/transpose(jvp(EncoderDecoder))/EncoderDecoder.encode/encoder/while/"
        "body/closed_call/scan_0/checkpoint/rematted_computation/layers_0_4_8/self_attention/"
        "attention/mul": "encoder self_attention",
        "jit(train_step)/transpose(jvp(EncoderDecoder))/EncoderDecoder.decode/decoder/"
        "layers_11/ffn/moe/sort/scatter-add": "decoder ffn",
        "jit(train_step)/transpose(jvp(EncoderDecoder))/EncoderDecoder.decode/decoder/"
        "token_embedder/jit(_take)/scatter-add": "decoder token_embedder",
        "jit(train_step)/add": "outside the model",
        "": "outside the model",
    }
    assert {source: hlo_costs.part(source) for source in sources} == sources
    text = (
        "%body {\n  %t = f32[64]{0} parameter(0)\n"
        '  ROOT %n = f32[64]{0} negate(%t), metadata={op_name="jit(f)/M.apply/enc/layers_0/'
        'ffn/neg"}\n}\n'
        "%cond {\n  %t = f32[64]{0} parameter(0)\n  ROOT %k = pred[] constant(true)\n}\n"
        "ENTRY %main {\n  %t = f32[64]{0} parameter(0)\n"
        '  %a = f32[64]{0} add(%t, %t), metadata={op_name="jit(f)/add"}\n'
        "  ROOT %l = f32[64]{0} while(%a), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"3"}}\n}\n'
    )
    assert hlo_costs.bytes_by_part(hlo_costs.parse(text)) == {
        "enc ffn": 3 * 2 * 256,
        "outside the model": 3 * 256,
    }


def test_fusions_are_charged_for_the_slices_they_read_and_the_updates_they_write():
    """A fusion that reads one layer of a stacked array through a dynamic slice reads that
    layer, not the stack; one that writes a layer into the stack in place (its root a
    dynamic-update-slice of a parameter) reads none of the stack and writes the layer; a
    parameter used other than through slices is read whole."""
    text = (
        "%fused_slice {\n  %p0 = f32[12,256,64]{2,1,0} parameter(0)\n"
        "  %i = s32[] parameter(1)\n  %z = s32[] constant(0)\n"
        "  %ds = f32[1,256,64]{2,1,0} dynamic-slice(%p0, %i, %z, %z), "
        "dynamic_slice_sizes={1,256,64}\n  ROOT %b = f32[256,64]{1,0} bitcast(%ds)\n}\n"
        "%fused_update {\n  %p0 = f32[12,256,64]{2,1,0} parameter(0)\n"
        "  %p1 = f32[256,64]{1,0} parameter(1)\n  %i = s32[] parameter(2)\n"
        "  %z = s32[] constant(0)\n  %u = f32[1,256,64]{2,1,0} bitcast(%p1)\n"
        "  ROOT %dus = f32[12,256,64]{2,1,0} dynamic-update-slice(%p0, %u, %i, %z, %z)\n}\n"
        "%fused_negate {\n  %p0 = f32[12,256,64]{2,1,0} parameter(0)\n"
        "  ROOT %n = f32[12,256,64]{2,1,0} negate(%p0)\n}\n"
        "ENTRY %main {\n  %s = f32[12,256,64]{2,1,0} parameter(0)\n"
        "  %x = f32[256,64]{1,0} parameter(1)\n  %i = s32[] parameter(2)\n"
        "  %r = f32[256,64]{1,0} fusion(%s, %i), kind=kLoop, calls=%fused_slice\n"
        "  %w = f32[12,256,64]{2,1,0} fusion(%s, %x, %i), kind=kLoop, calls=%fused_update\n"
        "  ROOT %n = f32[12,256,64]{2,1,0} fusion(%w), kind=kLoop, calls=%fused_negate\n}\n"
    )
    layer, stack = 4 * 256 * 64, 4 * 12 * 256 * 64
    ops = {op.name: op for op in hlo_costs.parse(text)}
    assert (ops["r"].operand_bytes, ops["r"].output_bytes) == (layer + 4, layer)
    assert (ops["w"].operand_bytes, ops["w"].output_bytes) == (layer + 4, layer)
    assert (ops["n"].operand_bytes, ops["n"].output_bytes) == (stack, stack)


def test_gathers_are_charged_for_the_elements_they_take():
    """A take along the vocabulary (the target's logit) or an embedding lookup reads the
    gathered elements, not the whole table, whether fused or not; a fusion that also
    reduces the table reads it whole."""
    gather = (
        "gather(%{t}, %{i}), offset_dims={{1}}, collapsed_slice_dims={{0}}, "
        "start_index_map={{0}}, index_vector_dim=1, slice_sizes={{1,64}}"
    )
    text = (
        "%fused_take {\n  %p0 = f32[1000,64]{1,0} parameter(0)\n"
        "  %p1 = s32[16,1]{1,0} parameter(1)\n"
        f"  ROOT %g = f32[16,64]{{1,0}} {gather.format(t='p0', i='p1')}\n}}\n"
        "%fused_take_and_sum {\n  %p0 = f32[1000,64]{1,0} parameter(0)\n"
        "  %p1 = s32[16,1]{1,0} parameter(1)\n  %z = f32[] constant(0)\n"
        f"  %g = f32[16,64]{{1,0}} {gather.format(t='p0', i='p1')}\n"
        "  %r = f32[64]{0} reduce(%p0, %z), dimensions={0}, to_apply=%add\n"
        "  ROOT %t = (f32[16,64]{1,0}, f32[64]{0}) tuple(%g, %r)\n}\n"
        "ENTRY %main {\n  %table = f32[1000,64]{1,0} parameter(0)\n"
        "  %ids = s32[16,1]{1,0} parameter(1)\n"
        f"  %plain = f32[16,64]{{1,0}} {gather.format(t='table', i='ids')}\n"
        "  %fused = f32[16,64]{1,0} fusion(%table, %ids), kind=kLoop, calls=%fused_take\n"
        "  ROOT %both = (f32[16,64]{1,0}, f32[64]{0}) fusion(%table, %ids), kind=kInput, "
        "calls=%fused_take_and_sum\n}\n"
    )
    rows, table, ids = 4 * 16 * 64, 4 * 1000 * 64, 4 * 16
    ops = {op.name: op for op in hlo_costs.parse(text)}
    assert ops["plain"].operand_bytes == rows + ids
    assert ops["fused"].operand_bytes == rows + ids
    assert ops["both"].operand_bytes == table + ids


def test_tpu_convolutions_that_are_batched_matmuls_count_one_tap_per_output():
    """XLA:TPU writes einsums as convolutions whose window spans a batch-like dimension
    (attention heads): over an input of size 1 padded on both sides, or base-dilated so one
    tap per window is real. Each counts as the matmul it is (2 x result x contracted size),
    as XLA's cost analysis counts it, not once per tap of the window."""
    padded = (
        "ENTRY %main {\n  %x = bf16[16,512,768,1]{2,1,3,0} parameter(0)\n"
        "  %w = bf16[768,12,64,1]{2,0,1,3} parameter(1)\n"
        "  ROOT %c = bf16[16,512,12,64]{1,3,2,0} convolution(%x, %w), "
        "window={size=1x12 pad=0_0x11_11 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f\n}\n"
    )
    dilated = (
        "ENTRY %main {\n  %q = bf16[16,114,12,64]{1,3,2,0} parameter(0)\n"
        "  %k = bf16[16,114,12,64]{1,3,2,0} parameter(1)\n"
        "  ROOT %c = f32[16,12,114,114]{2,3,1,0} convolution(%q, %k), "
        "window={size=16x12 stride=15x11 lhs_dilate=16x12}, dim_labels=0b1f_0o1i->01bf\n}\n"
    )
    plain = (
        "ENTRY %main {\n  %x = f32[8,32,32,3]{3,2,1,0} parameter(0)\n"
        "  %w = f32[3,3,3,16]{3,2,1,0} parameter(1)\n"
        "  ROOT %c = f32[8,30,30,16]{3,2,1,0} convolution(%x, %w), "
        "window={size=3x3}, dim_labels=b01f_01io->b01f\n}\n"
    )
    flops = [hlo_costs.summary(hlo_costs.parse(t))["flops"] for t in (padded, dilated, plain)]
    assert flops == [
        2 * 16 * 512 * 12 * 64 * 768,
        2 * 16 * 12 * 114 * 114 * 64,
        2 * 8 * 30 * 30 * 16 * 3 * 3 * 3,
    ]


def test_matmul_flops_are_split_by_operand_type_fused_ones_included():
    """A bfloat16 dot inside a fusion (as XLA:TPU writes one) and a float32 cuBLAS GEMM (the
    float32 attention logits of a bf16 step on a GPU): each counted under its operands'
    type, and the report says the shares."""
    text = (
        "%fused_dot (p0: bf16[128,32], p1: bf16[32,96]) -> bf16[128,96] {\n"
        "  %p0 = bf16[128,32]{1,0} parameter(0)\n  %p1 = bf16[32,96]{1,0} parameter(1)\n"
        "  ROOT %d = bf16[128,96]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}\n}\n\n"
        "ENTRY %main {\n  %a = bf16[128,32]{1,0} parameter(0)\n"
        "  %b = bf16[32,96]{1,0} parameter(1)\n"
        "  %q = f32[64,16]{1,0} parameter(2)\n  %k = f32[16,64]{1,0} parameter(3)\n"
        "  %f = bf16[128,96]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot\n"
        "  ROOT %g = (f32[64,64]{1,0}, s8[4194304]{0}) custom-call(%q, %k), "
        'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":'
        '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
        '"rhs_contracting_dimensions":["0"]}}}\n}\n'
    )
    by_type = hlo_costs.matmul_flops_by_type(text)
    assert by_type == {"bf16": 2 * 128 * 96 * 32, "f32": 2 * 64 * 64 * 16}
    assert (
        compile_report.matmul_type_line(by_type)
        == "  matmul FLOPs by operand type: bf16 85.7%, f32 14.3%"
    )
    assert compile_report.matmul_type_line({}) == "  matmul FLOPs by operand type: no matmuls"


def test_report_says_what_the_estimate_counts_and_leaves_out_and_uses_plain_units():
    """The HBM term charges XLA's byte count where the compiler gives one, else the bytes
    of the HLO text (GPU executables compiled without a GPU), and the line says which; a
    chip without an HBM bandwidth leaves the term out and the estimate is labelled
    compute-and-collectives-only. Rates and sizes are plain numbers with unit prefixes,
    never 'e+'."""
    hlo = (
        "ENTRY %main {\n  ROOT %a = f32[1024,1024]{1,0} all-reduce(f32[1024,1024]{1,0} %p), "
        "to_apply=%add\n}\n"
    )
    facts = hardware.device_facts([None] * 8, hardware.CHIPS["h100"], 8)
    args = {"flops_per_step": 6.4e15, "tokens_per_step": 2**20, "num_devices": 8}
    from_text = step_analysis.hlo_analysis(hlo, facts, bytes_accessed=None, **args)
    text_bytes = from_text["per_step"]["bytes"]
    from_text = from_text["estimate"]
    known = step_analysis.hlo_analysis(hlo, facts, bytes_accessed=4e12, **args)["estimate"]
    no_hbm = dataclasses.replace(facts, hbm_bandwidth=None)
    unknown = step_analysis.hlo_analysis(hlo, no_hbm, bytes_accessed=None, **args)["estimate"]
    assert text_bytes >= 4 * 1024 * 1024  # at least the all-reduce's result, written
    assert from_text["hbm_s"] == pytest.approx(text_bytes / facts.hbm_bandwidth)
    assert known["hbm_s"] == pytest.approx(4e12 / facts.hbm_bandwidth)
    assert unknown["hbm_s"] is None
    assert known["step_s"] > from_text["step_s"] >= unknown["step_s"] > 0
    assert from_text["covers"] == ["compute", "HBM (HLO text)", "collectives"]
    assert known["covers"] == ["compute", "HBM", "collectives"]
    text_line = compile_report.estimate_line(from_text)
    assert "HBM bytes counted from the HLO text" in text_line and "only" not in text_line
    assert "HBM (HLO text) " in text_line.split(":", 2)[-1]
    line = compile_report.estimate_line(unknown)
    assert (
        "compute and collectives only" in line
        and "HBM" in line.split(":")[0]
        and "HBM 0" not in line
    )
    known_line = compile_report.estimate_line(known)
    assert "only" not in known_line and "HLO text" not in known_line and "HBM " in known_line
    for est in (unknown, from_text, known):
        text = compile_report.estimate_line(est)
        rate = re.search(r"([\d,]+) tokens/s", text).group(1)
        assert "e+" not in text and float(rate.replace(",", "")) == pytest.approx(
            2**20 / est["step_s"], rel=5e-3
        )
    assert [compile_report.plain(v) for v in (5355860, 1190.4, 8.93e-05, 0.5)] == [
        "5,360,000",
        "1,190",
        "0.0000893",
        "0.500",
    ]
    assert [
        compile_report.quantity(v, u)
        for v, u in ((7.06e8, "FLOP"), (34.6e6, "B"), (None, "B"), (512, "B"))
    ] == ["706 MFLOP", "34.6 MB", "unknown", "512 B"]


@pytest.mark.slow
def test_gpu_compile_of_the_smoke_config(tmp_path):
    """8 H100s from the bare CUDA PJRT plugin (`make compilers`; no CUDA libraries)."""
    code, output, report = compile_cli(
        tmp_path,
        "--target=gpu:h100:8",
        *SMOKE,
        "--gin_file=meshes/gpu_8x_h100.gin",
        "--gin.NUM_EXPERTS=8",
    )
    assert code == 0, output
    assert report["device_kind"].startswith("NVIDIA H100") and report["devices"] == 8
    assert report["moe_layer"] == {
        "platform": "gpu",
        "dispatch": "sort",
        "per_expert_loop": False,
        "implementation": "sort",
        "choice_major_combine": True,
        "exchange": "all_to_all",
        "grouped_matmul": False,
        "gather_gradients": True,
        "scatter_rows": False,
        "gather_in_kernel": False,
    }
    step = report["steps"]["train"]
    assert step["collectives"]["all-to-all"]["count"] >= 2
    assert 0 < step["bytes"]["total"] < step["bytes"]["device_memory"]
    # no cost analysis on GPU: the HBM term counts the HLO text's bytes, and says so
    assert step["hlo_bytes_accessed_per_device"] is None
    assert step["estimate"]["hbm_s"] * hardware.CHIPS["h100"].hbm_bandwidth == pytest.approx(
        step["per_step"]["bytes"]
    )
    assert "HBM bytes counted from the HLO text" in output and "only" not in output
    # the MoE layers' matmuls (cuBLAS calls) are counted: about a top-2-of-8 share of the model's
    assert 0 < step["moe_layers"]["flops"] < step["flops_per_step"] / report["devices"]
    assert "Could not find cuda drivers" not in output
