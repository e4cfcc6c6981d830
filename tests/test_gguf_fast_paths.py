"""The fast GGUF paths give what the `gguf` package gives: the compiled dequantisers the same
float32 bits as `gguf.quants.dequantize`, the bulk metadata reader the same fields as
`gguf.GGUFReader`, and the loader's host buffers what a device adopts without a copy."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as reference_dequantize

from cmoe_jax.loading import smollm2_gguf
from cmoe_jax.loading.gguf_dequant import _KERNELS, dequantize
from cmoe_jax.loading.gguf_reader import FastGGUFReader
from cmoe_jax.host_arrays import aligned_copy, aligned_empty, copy_into, is_aligned

# where each format keeps its float16 scales (byte offsets in a block)
F16_FIELDS = {GGMLQuantizationType.Q8_0: (0,), GGMLQuantizationType.Q4_1: (0, 2),
              GGMLQuantizationType.Q5_0: (0,), GGMLQuantizationType.Q4_K: (0, 2),
              GGMLQuantizationType.Q6_K: (208,)}


def random_blocks(qtype, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random quantised bytes `[rows, row_bytes]` whose float16 scales are finite."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = rng.normal(0, 0.05, raw.shape[0]).astype(np.float16)
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


def test_every_kernel_has_its_scale_layout_here():
    assert set(_KERNELS) == set(F16_FIELDS)


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=lambda q: q.name), ids=lambda q: q.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_gives_the_gguf_packages_bits(qtype, seed):
    data = random_blocks(qtype, rows=7, blocks_per_row=3, seed=seed)
    ours, ref = dequantize(data, qtype), reference_dequantize(data, qtype)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))
    assert is_aligned(ours)


def test_a_format_without_kernel_goes_through_the_gguf_package():
    rng = np.random.default_rng(0)
    data = rng.normal(size=(4, 64)).astype(np.float32).view(np.uint16)[:, 1::2].copy()  # bf16 bits
    qtype = GGMLQuantizationType.BF16
    assert qtype not in _KERNELS
    np.testing.assert_array_equal(dequantize(data.view(np.uint8), qtype),
                                  reference_dequantize(data.view(np.uint8), qtype))


def write_gguf(path, arrays: dict, scalars: dict):
    w = GGUFWriter(str(path), "llama")
    for key, value in scalars.items():
        w.add_key_value(key, value[0], value[1])
    for key, value in arrays.items():
        w.add_array(key, value)
    w.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_reader(ref: GGUFReader, fast: FastGGUFReader):
    assert list(ref.fields) == list(fast.fields)
    for key, a in ref.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.data, a.types, len(a.parts)) == (b.offset, b.data, b.types, len(b.parts)), key
        assert a.contents() == b.contents(), key
        assert all(bytes(x.tobytes()) == bytes(y.tobytes()) for x, y in zip(a.parts, b.parts)), key
    assert [(t.name, t.data_offset) for t in ref.tensors] == [(t.name, t.data_offset) for t in fast.tensors]


def test_fast_reader_gives_the_gguf_readers_fields(tmp_path):
    from gguf import GGUFValueType as V

    path = tmp_path / "m.gguf"
    write_gguf(path, arrays={
        "tokens": ["a", "", "naïve 東京 🙂", "x" * 300], "ids": [3, -1, 7], "scores": [0.5, -2.25],
        "flags": [True, False, True], "empty": [],
    }, scalars={"name": ("tiny", V.STRING), "count": (5, V.UINT32), "eps": (1e-6, V.FLOAT32)})
    assert_same_reader(GGUFReader(str(path)), FastGGUFReader(str(path)))


def test_fast_reader_reads_the_embedded_model_as_the_gguf_reader_does():
    path = str(smollm2_gguf())
    assert_same_reader(GGUFReader(path), FastGGUFReader(path))


def test_fast_reader_refuses_a_string_array_cut_short(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, arrays={"tokens": ["abc", "defgh"]}, scalars={})
    data = path.read_bytes()
    cut = data.index(b"defgh") + 2
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError):
        FastGGUFReader(str(tmp_path / "cut.gguf"))


def test_copy_into_places_a_transposed_view():
    a = np.random.default_rng(0).normal(size=(300, 170)).astype(np.float32)
    out = aligned_empty((170, 300), np.float32)
    copy_into(out, a.T)
    np.testing.assert_array_equal(out, a.T)
    assert is_aligned(out)
    half = aligned_copy(a.T, jax.numpy.bfloat16)  # a cast goes through numpy
    np.testing.assert_array_equal(half, a.T.astype(jax.numpy.bfloat16))


def test_a_cpu_device_adopts_an_aligned_host_buffer():
    """What keeps a loaded model held once: `device_put` on a CPU aliases 64-byte-aligned data."""
    host = aligned_copy(np.arange(4096, dtype=np.float32).reshape(64, 64), np.float32)
    placed = jax.device_put(host, jax.devices("cpu")[0])
    assert placed.unsafe_buffer_pointer() == host.ctypes.data
