"""The grouped-matmul kernels lower for the hardware this CPU cannot reach.

`jax.export` with `platforms=["cuda"]` runs the Pallas Triton lowering of `gmm_pallas_gpu`
and with `platforms=["tpu"]` the Mosaic TPU lowering of megablox (`gmm_tpu`), forward and
backward (the custom VJP), fp32 and bf16, at the default (production) tiles and at
Llama-2-7B expert shapes (d=4096, d_h=11008 cut into 8 experts of 1376). Only shapes are
traced (ShapeDtypeStruct), nothing is materialised. Each test checks the module calls the
expected kernels. What this cannot check: Triton's / Mosaic's own compilation to machine
code (shared memory, register pressure), which happens on the device.
"""
import re

import pytest

import jax
import jax.numpy as jnp

from cmoe_jax.moe.gmm import pallas_gpu as gmm_pallas_gpu, tpu as gmm_tpu

TRITON = "__gpu$xla.gpu.triton"
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
# (tokens*k rows, d_model, expert width, experts): Llama-2-7B S1A1E8 routed experts; a small case
SHAPES = {"llama2_7b": (4096, 4096, 1376, 7), "small": (256, 128, 64, 4)}


def export(fn, platform, rows, d, m, experts, dtype):
    """Export value and (lhs, rhs) gradient of sum(gmm(x, w_up)^2) for `platform`."""
    def loss(x, w, sizes):
        return jnp.sum(fn(x, w, sizes).astype(jnp.float32) ** 2)

    args = (jax.ShapeDtypeStruct((rows, d), dtype), jax.ShapeDtypeStruct((experts, d, m), dtype),
            jax.ShapeDtypeStruct((experts,), jnp.int32))
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)] if platform == "cuda" else []
    # JAX >= 0.11 lowers Pallas Triton only for a known GPU: name one when exporting from a CPU
    # host (JAX 0.10 fell back to sm_90 itself and ignores the abstract device)
    target = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
        "NVIDIA H100", 1, "cuda")) if platform == "cuda" else jax.sharding.get_abstract_mesh()
    with jax.sharding.use_abstract_mesh(target):
        exp = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                                platforms=[platform], disabled_checks=checks)(*args)
    return exp.mlir_module()


def kernel_calls(text, target):
    """backend_config of each custom call to `target`, the serialised kernel IR left out."""
    lines = [ln for ln in text.splitlines() if f"custom_call @{target}(" in ln]
    return [re.sub(r'ir = "[^"]*"', "ir = ...", ln) for ln in lines]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pallas_gpu_lowers_to_triton(shape, dtype):
    text = export(gmm_pallas_gpu.gmm, "cuda", *SHAPES[shape], DTYPES[dtype])
    calls = kernel_calls(text, TRITON)
    # forward gmm, backward gmm (d lhs) and tgmm (d rhs)
    assert [re.search(r'name = "(\w+)"', c)[1] for c in calls] == ["cmoe_gmm", "cmoe_gmm", "cmoe_tgmm"]
    params = gmm_pallas_gpu.launch_params(gmm_pallas_gpu.default_tiles(DTYPES[dtype]), DTYPES[dtype])
    for c in calls:
        assert f"num_warps = {params.num_warps}" in c and f"num_stages = {params.num_stages}" in c
    assert "mosaic_gpu" not in text


def test_pallas_gpu_ignores_the_global_mosaic_flag():
    """Triton is chosen by the kernels' compiler params, whatever jax_pallas_use_mosaic_gpu says."""
    if not hasattr(jax.config, "jax_pallas_use_mosaic_gpu"):
        pytest.skip("JAX >= 0.12 has no jax_pallas_use_mosaic_gpu flag (Triton is the default)")
    before = jax.config.jax_pallas_use_mosaic_gpu
    for flag in (True, False):
        jax.config.update("jax_pallas_use_mosaic_gpu", flag)
        try:
            text = export(gmm_pallas_gpu.gmm, "cuda", *SHAPES["small"], jnp.float32)
        finally:
            jax.config.update("jax_pallas_use_mosaic_gpu", before)
        assert len(kernel_calls(text, TRITON)) == 3


@pytest.mark.parametrize("precision", ["tf32", "bf16x3"])
def test_pallas_gpu_fp32_precision_options_lower(precision):
    fn = gmm_pallas_gpu.make_gmm(precision=precision)
    text = export(fn, "cuda", *SHAPES["small"], jnp.float32)
    assert len(kernel_calls(text, TRITON)) == 3


def test_pallas_gpu_launch_params_follow_tiles():
    bf16 = gmm_pallas_gpu.launch_params((128, 64, 128), jnp.bfloat16)
    assert (bf16.num_warps, bf16.num_stages) == (8, 3)  # 32 KiB per stage
    f32 = gmm_pallas_gpu.launch_params((64, 32, 128), jnp.float32)
    assert (f32.num_warps, f32.num_stages) == (4, 4)    # 24 KiB per stage
    assert gmm_pallas_gpu.launch_params((128, 128, 128), jnp.float32).num_stages == 2
    with pytest.raises(ValueError, match="unknown precision"):
        gmm_pallas_gpu.make_gmm(precision="fp8")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_megablox_lowers_to_tpu_custom_call(shape, dtype):
    text = export(gmm_tpu.gmm, "tpu", *SHAPES[shape], DTYPES[dtype])
    assert len(kernel_calls(text, "tpu_custom_call")) == 3  # gmm, gmm (d lhs), tgmm (d rhs)
