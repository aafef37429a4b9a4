"""benchmarks/moe_layer.py's device table (``measure_layers``) at tiny sizes on this CPU, so
that the accelerator benchmark cannot rot; it imports no seqio / TensorFlow."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax.numpy as jnp

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import moe_layer  # noqa: E402  (benchmarks/ is not a package)


def test_measure_layers_times_and_checks_each_implementation():
    rows = moe_layer.measure_layers(
        8,
        ("einsum", "sort", "dropless", "dropless:xla"),
        dtype=jnp.float32,
        reps=1,
        **moe_layer.QUICK_SIZES,
    )
    by_impl = {row["impl"]: row for row in rows}
    assert list(by_impl) == ["einsum", "sort", "dropless", "dropless:xla", "dense FFN", "matmul"]
    assert all(row["ms"] > 0 and row["useful_tflops"] > 0 for row in rows)
    assert by_impl["dense FFN"]["vs_dense"] == 1.0 and by_impl["matmul"]["of_matmul"] == 1.0
    assert by_impl["dense FFN"]["of_dense_rate"] == 1.0
    # rate vs the dense FFN's = time ratio x useful-FLOP ratio: dropless computes every
    # assignment (2 x 128 rows), the capacity layer and the dense FFN its 8 x 10 x 2 slots
    for impl, rows_computed in (("sort", 160), ("dropless", 256)):
        row = by_impl[impl]
        expected = row["vs_dense"] * rows_computed / 160
        assert abs(row["of_dense_rate"] - expected) < 1e-9 * expected, (impl, row)
    # the same rows as the reference: float32 summation order apart, identical
    assert by_impl["sort"]["max_rel_diff"] < 1e-5
    assert by_impl["dropless"]["max_rel_diff"] == 0.0  # on CPU the plan's matmul is xla
    assert "max_rel_diff" not in by_impl["einsum"]
    assert {row["device"] for row in rows} == {"cpu"} and rows[0]["capacity"] == 10


def test_an_implementation_the_device_lacks_is_reported_not_raised():
    # tokamax's Triton kernel does not trace on a CPU: the layer falls back to xla, and the
    # row that names the kernel says so instead of timing xla under its name
    rows = moe_layer.measure_layers(
        8, ("sort", "dropless:triton"), dtype=jnp.float32, reps=1, **moe_layer.QUICK_SIZES
    )
    failed = [row for row in rows if "error" in row]
    assert [row["impl"] for row in failed] == ["dropless:triton"]
    assert failed[0]["error"].startswith("fell back to xla (forward: NotImplementedError")
    assert {row["impl"] for row in rows} == {"sort", "dropless:triton", "dense FFN", "matmul"}


def test_the_benchmark_imports_no_seqio_or_tensorflow():
    code = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import moe_layer; "
        "bad = {'seqio', 'tensorflow'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
