"""poly.tiling: Loom's worked examples (inventory §3.3/3.4) with a fixed HardwareInfo, and the probe."""

from __future__ import annotations

import pytest

from poly.dtypes import DType
from poly.errors import LayerConfigError
from poly.tiling import (
    GPULimits,
    HardwareInfo,
    cpu_tile_sizes,
    gpu_tile_from_limits,
    gpu_tile_sizes,
    hardware_info,
)

D = DType
HW32 = HardwareInfo(l1d=32 * 1024, l2=256 * 1024, l3=8 << 20, num_cpus=2)
ONE_BYTE = [dt for dt in DType if dt.tile_bytes == 1]  # int8, fp8, 4/2/1-bit kinds
KINDS = ["dense", "mha", "swiglu", "rmsnorm", "residual", "embedding", "sequential"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_covers_all_21_dtypes(kind):
    sizes = cpu_tile_sizes(kind, d_model=576, input_height=576, output_height=1536, hw=HW32)
    assert set(sizes) == set(DType) and all(v >= 1 for v in sizes.values())
    sc, mc = gpu_tile_sizes(kind, head_dim=64)
    assert set(sc) == set(DType) == set(mc)


def test_mha_worked_examples():
    # SmolLM2-135M: DModel 576 -> f32 8, int8-class 32; DModel 1024 -> f32 8, int 32.
    smol = cpu_tile_sizes("mha", d_model=576, query_dim=576, kv_dim=192, hw=HW32)
    assert smol[D.FLOAT32] == 8 and smol[D.FLOAT16] == 8 and smol[D.BFLOAT16] == 8
    assert all(smol[dt] == 32 for dt in ONE_BYTE)
    big = cpu_tile_sizes("mha", d_model=1024, query_dim=1024, kv_dim=256, hw=HW32)
    assert big[D.FLOAT32] == 8 and big[D.INT8] == 32 and big[D.INT4] == 32
    # 2-byte kinds: 32768 / (2*576) = 28.4 -> 16; 8-byte: 7.1 -> minimum 8
    assert smol[D.INT16] == 16 and smol[D.FLOAT64] == 8
    tiny = cpu_tile_sizes("mha", d_model=16, query_dim=16, kv_dim=8, hw=HW32)
    assert tiny[D.INT8] == 16  # capped to d_model


def test_residual_embedding_and_defaults():
    res = cpu_tile_sizes("residual", hw=HW32)
    assert res[D.FLOAT32] == 2048  # 32768 / 12 = 2730 -> 2048
    assert res[D.FLOAT64] == 1024 and res[D.INT8] == 2048
    assert cpu_tile_sizes("residual", hw=HardwareInfo(l1d=512))[D.FLOAT32] == 64  # floor
    emb = cpu_tile_sizes("embedding", embedding_dim=576, hw=HW32)
    assert emb[D.FLOAT32] == 8 and emb[D.INT8] == 32
    for kind in ("rmsnorm", "sequential"):
        assert set(cpu_tile_sizes(kind, hw=HW32).values()) == {8}


def test_swiglu_and_dense_caps():
    sw = cpu_tile_sizes("swiglu", input_height=576, output_height=1536, hw=HW32)
    assert sw[D.FLOAT32] == 8 and sw[D.INT8] == 32
    narrow = cpu_tile_sizes("swiglu", input_height=64, output_height=20, hw=HW32)
    assert narrow[D.INT8] == 20  # 32768/64 = 512 -> 256, capped by min(in, out)
    dense = cpu_tile_sizes("dense", input_height=64, output_height=20, hw=HW32)
    assert dense[D.INT8] == 64  # capped by max(in, out)
    assert cpu_tile_sizes("dense", hw=HW32)[D.FLOAT32] == 256  # no dims: no cap


def test_larger_l1_gives_larger_tiles():
    hw64 = HardwareInfo(l1d=64 * 1024)
    assert cpu_tile_sizes("mha", d_model=576, hw=hw64)[D.FLOAT32] == 16  # 65536/2304 = 28.4


def test_gpu_rules_with_default_limits():
    assert gpu_tile_from_limits(32768, 256, 64) == 32  # (16384) / (64*2*4)
    assert gpu_tile_from_limits(0, 0, 64) == 32  # no limits: fallback
    assert gpu_tile_from_limits(1 << 20, 16, 64) == 16  # capped by invocations
    sc, mc = gpu_tile_sizes("mha", head_dim=64)
    assert (sc[D.FLOAT32], mc[D.FLOAT32]) == (16, 32)
    assert (sc[D.INT8], mc[D.INT8]) == (24, 48)  # x1.5 for small types
    sc, mc = gpu_tile_sizes("swiglu")
    assert (sc[D.FLOAT32], mc[D.FLOAT32]) == (128, 256)
    assert (sc[D.INT8], mc[D.INT8]) == (128, 256)  # 512 -> 256 >= mc -> mc/2
    sc, mc = gpu_tile_sizes("rmsnorm")
    assert (sc[D.FLOAT32], mc[D.FLOAT32]) == (32, 64)
    assert (sc[D.FLOAT16], mc[D.FLOAT16]) == (32, 64)  # f16 counts as 4 bytes
    assert (sc[D.INT16], mc[D.INT16]) == (64, 128)
    sc, mc = gpu_tile_sizes("dense_kernel", limits=GPULimits(32768, 256))
    assert (sc[D.FLOAT32], mc[D.FLOAT32]) == (32, 256) and sc[D.INT8] == 128


def test_unknown_kind_is_an_error():
    with pytest.raises(LayerConfigError):
        cpu_tile_sizes("conv9", hw=HW32)
    with pytest.raises(LayerConfigError):
        gpu_tile_sizes("conv9")


def _cache_dir(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_probe_reads_sysfs_layout(tmp_path):
    root = _cache_dir(
        tmp_path, [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                   (3, "Unified", "16M")]
    )  # fmt: skip
    hw = HardwareInfo.probe(root)
    assert (hw.l1d, hw.l2, hw.l3) == (48 * 1024, 2 << 20, 16 << 20) and hw.num_cpus >= 1


def test_probe_defaults_when_missing_or_garbled(tmp_path):
    hw = HardwareInfo.probe(tmp_path / "nope")
    assert (hw.l1d, hw.l2, hw.l3) == (32768, 262144, 8388608)
    root = _cache_dir(tmp_path, [(1, "Data", "lots")])
    assert HardwareInfo.probe(root).l1d == 32768
    assert hardware_info() is hardware_info()  # probed once
