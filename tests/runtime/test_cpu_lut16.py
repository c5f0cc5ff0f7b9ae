"""Exponential codes on lowbit's 16-entry-LUT CPU kernel: against the reference on every group
size, odd shapes, 1-12 rows, on each ISA; the bytes it holds; the runtime's choice of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline import cpu_ext
from pipeline.artifact.lowbit_format import pack_linear, plan_layer, unpack_linear
from pipeline.quant.rtn import quantize_rtn
from pipeline.runtime import cpu_lut16, kernels
from pipeline.runtime.kernels import build, exp_kernel_name, relative_error
from tests.runtime.test_kernels import CODE_ISAS, _codes, needs_kernels

# every group size exp formats have, with n (no tile here) and k neither a power of two
EXP = [("exp4g32", (40, 160)), ("exp4g64", (24, 192)), ("exp4g128", (48, 384))]
EXP += [("exp4g128", (16, 2560))]  # 20 groups: AVX-512's factors for 16 groups, then 4
# the method's formula grid: the same codes and LUT layout, a ratio per group on a 1/256 grid
EXP += [("exp4g32-design", (40, 160))]
# Both ISAs multiply int16 table entries by activations rounded per group to 14 bits at g32 ...
# 12 bits at g128 (measured 5e-5 ... 2.1e-4); AVX-512 at g32, too short for its 64-column step,
# multiplies float32 (the reference's products, summed in another order). A wrong nibble, table
# or lane order costs O(1).
INT16_TOL, FLOAT_TOL = 5e-4, 1e-5


def tol(isa: str, group_len: int) -> float:
    return FLOAT_TOL if isa != "avx2" and group_len % 64 else INT16_TOL


@pytest.mark.parametrize("isa", CODE_ISAS)
@pytest.mark.parametrize(("fmt", "shape"), EXP)
def test_lut16_matches_the_reference(fmt, shape, isa):
    _, codes = _codes(fmt, shape)
    assert cpu_lut16.fits(codes)
    layer, bound = kernels.Lut16(codes, isa), tol(isa, codes.group_len)
    assert layer.tables.shape[0] > 1  # several ratios: the per-group table choice is exercised
    ref = kernels.Reference(codes)
    torch.manual_seed(2)
    for rows in range(1, 13):  # one pass of rows and two (AVX-512 takes 8 a pass, AVX2 4)
        x = torch.randn(rows, shape[1])
        got = layer(x)
        assert got.shape == (rows, shape[0]) and got.dtype == x.dtype
        assert relative_error(got, ref(x)) < bound
    assert relative_error(layer(x.bfloat16()), got) < 1e-2  # bf16 in, bf16 out
    # every lane at its largest product (AVX2: 4 x 32767 x 16384 must stay inside int32)
    top = dataclasses.replace(codes, q=torch.ones_like(codes.q))  # code 1: a table's top level
    x = torch.full((2, shape[1]), 3.0)
    x[1, ::7] = -5.0  # and a group's scale set by other columns
    got, want = kernels.Lut16(top, isa)(x), kernels.Reference(top)(x)
    assert relative_error(got, want) < bound


def test_lut16_holds_four_bits_per_weight():
    _, codes = _codes("exp4g128", (48, 384))
    packed, base, ridx, tables = cpu_lut16.pack(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 48 * 384 // 2
    assert base.dtype == torch.float16 and base.shape == ridx.shape == (48, 3)
    assert torch.equal(base.float(), codes.scale)  # stored in float16: exact
    # each group's table, times its base, is the group's own LUT
    torch.testing.assert_close(tables[ridx.long()] * codes.scale[..., None], codes.lut())


@needs_kernels
def test_runtime_picks_lut16_for_exp_codes_on_lowbit_cpus():
    qt, codes = _codes("exp4g64", (24, 192))
    layer = build(codes)
    assert layer.name == exp_kernel_name() == "exp4lut"
    x = torch.randn(3, 192)
    assert relative_error(layer(x), x @ qt.dequantize().T) < tol(cpu_ext.isa(), 64)
    _, partial = _codes("exp4g64", (24, 160))  # a partial last group: the bf16 copy serves
    assert not cpu_lut16.fits(partial) and build(partial).name == "dense-bf16"


@needs_kernels
def test_the_design_grid_fits_the_lut_kernel_at_any_spread_of_magnitudes():
    """Its ratios follow each group's magnitude; on the 1/256 grid a layer never needs more than
    the 256 tables a byte indexes, however widely its groups' magnitudes spread."""
    torch.manual_seed(3)
    w = torch.randn(64, 512) * torch.logspace(-4, 1, 64)[:, None]  # 5 decades across rows
    qt = quantize_rtn(w, "exp4g32-design")
    info = plan_layer("l", qt.fmt, qt.shape, "lowbit")
    codes = unpack_linear(pack_linear(qt, info), info)
    assert cpu_lut16.fits(codes) and codes.ratio.unique().numel() > 64
    layer = build(codes)
    assert layer.name == "exp4lut"
    x = torch.randn(2, 512)
    assert relative_error(layer(x), x @ qt.dequantize().T) < tol(cpu_ext.isa(), 32)
