"""benchmarks/bench_jax_graph.py: the op counts of the jitted JAX train
step (issue 29's deterministic companion of bench_jax's step times). The
counting rules against programs counted by hand, and the script's rows."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# XLA's CPU module for `a * b + a` on two f32[3] (jax 0.10), as printed:
# 7 instructions (two parameters of the entry, two of the fused
# computation, its multiply and add, the fusion), one of them a fusion.
COMPILED = """HloModule jit__lambda, is_scheduled=true, entry_computation_layout={(f32[3]{0}, f32[3]{0})->f32[3]{0}}

FileLocations
1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=2 end_column=59}

%fused_computation (param_0.1: f32[3], param_1.1: f32[3]) -> f32[3] {
  %param_0.1 = f32[3]{0} parameter(0)
  %param_1.1 = f32[3]{0} parameter(1)
  %mul.0 = f32[3]{0} multiply(%param_0.1, %param_1.1), metadata={op_name="jit(<lambda>)/mul"}
  ROOT %add.0 = f32[3]{0} add(%mul.0, %param_0.1), metadata={op_name="jit(<lambda>)/add"}
}

ENTRY %main.1 (a.1: f32[3], b.1: f32[3]) -> f32[3] {
  %a.1 = f32[3]{0} parameter(0), metadata={op_name="a"}
  %b.1 = f32[3]{0} parameter(1), metadata={op_name="b"}
  ROOT %multiply_add_fusion = f32[3]{0} fusion(%a.1, %b.1), kind=kLoop, calls=%fused_computation
}
"""

pytestmark = pytest.mark.needs_tensorflow(
    reason="benchmarks/bench_jax_graph.py imports the benchmarks' TensorFlow harness"
)


@pytest.fixture(scope="module")
def bench():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_jax_graph_under_test", os.path.join(ROOT, "benchmarks", "bench_jax_graph.py")
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    return module


def test_stablehlo_ops_are_counted_one_per_operation(bench):
    lowered = jax.jit(lambda a, b: a * b + a).lower(jnp.ones(3), jnp.ones(3))
    assert bench.stablehlo_ops(lowered.as_text()) == 2  # multiply, add (not the return)
    called = jax.jit(lambda a: jnp.sin(jax.jit(lambda b: b * 2.0)(a)))
    text = called.lower(jnp.ones(3)).as_text()
    # the call of the inner function, sin; inside it the constant 2.0, its
    # broadcast to the shape of `b` and the multiply (jax 0.10's lowering)
    assert bench.stablehlo_ops(text) == 5


def test_compiled_instructions_of_a_module_counted_by_hand(bench):
    assert bench.compiled_instructions(COMPILED) == (7, 1)


def test_main_reports_each_pair_with_both_counts(bench, monkeypatch):
    reported = {}
    monkeypatch.setattr(  # leaves benchmarks/out/ alone
        bench, "report", lambda title, results, targets, out: reported.update(locals())
    )
    bench.main(["--models", "mlp_64x256_b64"])
    assert reported["out"] == "jax_graph" and reported["targets"] == {}
    results = reported["results"]
    assert len(results) == 2 * len(bench.ROWS)
    for name, stats in results.items():
        a, b = stats["counts"]
        assert a > 0 and b > 0 and stats["median"] == a / b, name
    # the same program counted twice is the same count: Keras' step and the
    # gated one share every op but the gate
    gate = results[
        "JAX MLP 64-3x256-10: stablehlo ops: keras.Model gated / keras.Model (the gate alone)"
    ]
    assert gate["counts"][0] > gate["counts"][1]
    with pytest.raises(ValueError, match="`--models` must name models of"):
        bench.main(["--models", "mlp_64x256_b64,nope"])
