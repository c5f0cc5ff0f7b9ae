"""Packed kernels against the reference they replace, the choice per format, the fallbacks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from pipeline import cpu_ext
from pipeline.artifact.lowbit_format import pack_linear, plan_layer, unpack_linear
from pipeline.quant.rtn import quantize_rtn
from pipeline.runtime import cpu_w4a8, kernels
from pipeline.runtime.backends import TorchQuantLinear, kernel_summary
from pipeline.runtime.inmemory import runtime_linear, to_runtime
from pipeline.runtime.kernels import (
    TOLERANCE,
    build,
    exp_kernel_name,
    int_kernel_name,
    relative_error,
)
from tests._require import needs


def _codes(fmt, shape=(64, 256)):
    torch.manual_seed(1)
    qt = quantize_rtn(torch.randn(*shape) * 0.02, fmt)
    info = plan_layer("l", qt.fmt, qt.shape, "lowbit")
    return qt, unpack_linear(pack_linear(qt, info), info)


# int8 activations per 32 columns (Q8_0): a rounding error of max|x| / 254 per element,
# ~0.5% relative on Gaussian rows (measured 5.4e-3); an unpacking bug costs O(1).
W4A8_TOL = 1e-2


@pytest.mark.parametrize(
    ("fmt", "want"),
    [
        ("int4g128", "int"),  # "int": int_kernel_name(bits), w<bits>a8pack or int4pack
        ("int4g32-sym", "int"),
        ("int3g64", "int"),
        ("int2g64", "int"),
        ("int4", "int"),  # per channel: int4pack repeats the scale per 256-column block
        ("int2", "int"),
        ("int8", "int8"),  # "int8": w8a8pack, or int8pack (the offset folded as -sum(x) * o * s)
        ("int8-sym", "int8"),
        ("exp4g128", "exp"),  # "exp": exp_kernel_name(), exp4lut or dense-bf16
        ("int8g128", "int8g"),  # w8a8pack, or the reference: torch has no grouped int8 kernel
    ],
)
def test_kernel_matches_reference(fmt, want):
    qt, codes = _codes(fmt)
    ours = int_kernel_name() == "w4a8pack"  # lowbit's kernels run here (any ISA)
    want = {
        "int": int_kernel_name(bits=codes.info.bits),
        "int8": int_kernel_name(bits=8),
        "int8g": "w8a8pack" if ours else "reference",
        "exp": exp_kernel_name(),
    }.get(want, want)
    layer = build(codes)
    assert layer.name == want
    x = torch.randn(5, 256)
    ref = x @ qt.dequantize().T  # the oracle: the quantizer's own dequantization
    err = relative_error(layer(x), ref)
    # bf16 activations and scales cost ~3e-3, int8 activations ~5e-3; an unpacking bug (a
    # swapped nibble, a wrong zero) costs O(1).
    assert err < (1e-6 if want == "reference" else W4A8_TOL), err
    assert layer(x).dtype == x.dtype  # the caller's dtype comes back


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        ("int4g128", (64, 200)),  # k not a multiple of the group: no whole blocks
        ("int4g64", (40, 256)),  # n not a multiple of 16 (the int4 packing's tile)
        ("int8", (64, 200)),  # k % 16 != 0: the int8 kernel would read past the row
    ],
)
def test_shapes_a_kernel_cannot_take_fall_back_to_reference(fmt, shape):
    qt, codes = _codes(fmt, shape)
    layer = build(codes)
    assert layer.name == "reference"
    x = torch.randn(2, shape[1])
    torch.testing.assert_close(layer(x), x @ qt.dequantize().T)


def test_a_kernel_that_disagrees_is_replaced_and_named(monkeypatch, caplog):
    _, codes = _codes("int4g128")

    def wrong(self, x):  # e.g. a platform whose packing convention differs
        return torch.zeros(x.shape[0], 64)

    chosen = type(build(codes, check=False))
    monkeypatch.setattr(chosen, "forward", wrong)
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.kernels"):
        layer = build(codes, name="model.layers.0.mlp.up_proj")
    assert layer.name == "reference"
    assert "model.layers.0.mlp.up_proj" in caplog.text and "differs" in caplog.text
    # unchecked, the wrong kernel stays: the check is what catches it
    assert build(codes, check=False).name == chosen.name


def test_a_kernel_that_raises_falls_back(monkeypatch, caplog):
    _, codes = _codes("int8")

    def refuse(self, x):
        raise RuntimeError("no kernel for this device\nsecond line")

    monkeypatch.setattr(kernels.Int8Pack, "forward", refuse)
    monkeypatch.setattr(kernels.W4A8, "forward", refuse)  # w8a8pack, where it runs
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.kernels"):
        assert build(codes, name="lm").name == "reference"
    assert "RuntimeError: no kernel for this device" in caplog.text
    assert "second line" not in caplog.text


def test_reference_on_request_and_unknown_kernel():
    _, codes = _codes("int4g128")
    assert build(codes, kernel="reference").name == "reference"
    with pytest.raises(ValueError, match="kernel must be one of"):
        build(codes, kernel="fast")
    packed = TorchQuantLinear(codes, kernel="auto")
    with pytest.raises(TypeError, match="reference"):
        packed.weight_matrix()


def test_bias_batch_dims_and_w8a8_dynamic():
    qt, codes = _codes("int8-sym")
    bias = torch.randn(64)
    layer = TorchQuantLinear(codes, bias, kernel="auto")
    x = torch.randn(2, 3, 256)
    got = layer(x)
    assert got.shape == (2, 3, 64) and layer.kernel == int_kernel_name(bits=8)
    assert relative_error(got, x @ qt.dequantize().T + bias) < 1e-2


def test_to_runtime_converts_a_fake_quant_model(qmodels):
    from pipeline.quant.fakequant import FakeQuantLinear

    model = qmodels.fp_model().eval()
    mlp = model.model.layers[0].mlp
    for name, fmt in (("up_proj", "int4g64"), ("down_proj", "exp4g64"), ("gate_proj", "float")):
        mlp.set_submodule(name, FakeQuantLinear.from_linear(getattr(mlp, name), fmt))
    rt = to_runtime(model)
    assert kernel_summary(rt) == f"{int_kernel_name()} x1, {exp_kernel_name()} x1"
    assert isinstance(model.model.layers[0].mlp.up_proj, FakeQuantLinear)  # a copy converted
    assert isinstance(rt.model.layers[0].mlp.gate_proj, FakeQuantLinear)  # float stays
    x = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        err = relative_error(rt(input_ids=x).logits, model(input_ids=x).logits)
    assert err < TOLERANCE
    qt = model.model.layers[0].mlp.up_proj.to_qtensor()
    ref = runtime_linear("up", qt, kernel="reference")
    assert ref.kernel == "reference" and torch.equal(ref.weight_matrix(), qt.dequantize())


@pytest.mark.parametrize("fmt", ["int4g128", "int3g64", "int2g32"])
def test_int4pack_matches_reference(fmt):
    # the CUDA path and the CPU path without lowbit's kernels: tested directly, as this CPU may
    # not pick it
    qt, codes = _codes(fmt)
    layer = kernels.Int4Pack(codes, codes.group_len, torch.device("cpu"))
    x = torch.randn(3, 256)
    assert relative_error(layer(x), x @ qt.dequantize().T) < 1e-2


NO_ISA = "this CPU has neither AVX2 nor AVX-512 VNNI, which lowbit's CPU kernels need"
UNBUILT = "lowbit's CPU extension did not build (no compiler?)"


def isa_params() -> list:
    """One parameter per ISA whose kernels this CPU runs, so each ISA's kernels are tested where
    the CPU has it; where it runs none or the extension did not build, parameters that skip (fail
    under LOWBIT_REQUIRE=kernels)."""
    runs = cpu_ext.supported()
    if not runs:
        return [pytest.param(None, marks=needs("kernels", NO_ISA))]
    if cpu_ext.loaded() is None:
        return [pytest.param(i, marks=needs("kernels", UNBUILT)) for i in runs]
    return list(runs)


def _runtime_kernels_missing() -> str | None:
    """Why the runtime of this process does not run lowbit's kernels, or None when it does."""
    if cpu_ext.extension() is not None:
        return None
    if not cpu_ext.supported():
        return NO_ISA
    if cpu_ext.isa() is None:
        chosen = f"{cpu_ext.ENV}={os.environ.get(cpu_ext.ENV)}"
        return f"{chosen} gives the runtime torch's kernels (unset it to run lowbit's)"
    return UNBUILT


ISAS = isa_params()
# Only W4A8 has GFNI code: lut16, f32 rows and the decode ops run avx512's under avx512gfni, so
# their tests take every ISA but that one (test_avx512gfni_runs_avx512s_other_kernels: dispatch)
CODE_ISAS = [i for i in ISAS if i != "avx512gfni"]
needs_kernels = needs("kernels", _runtime_kernels_missing())
built = needs("kernels", UNBUILT if cpu_ext.loaded() is None else None)
W4A8_FORMATS = ["int4g32", "int4g128", "int3g64", "int2g64", "int4", "int2g128", "int8",
                "int8g64-sym"]  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", W4A8_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 17])  # 9 and 17: more than one pass of rows
def test_w4a8_matches_reference(fmt, rows, isa):
    _, codes = _codes(fmt, (48, 384))
    assert codes.offset.any() or fmt in ("int4", "int8g64-sym")  # the zero term is exercised
    layer = kernels.W4A8(codes, isa)
    assert layer.name == f"w{codes.info.bits}a8pack"
    assert layer.isa == isa
    x = torch.randn(rows, 384)
    got = layer(x)
    assert got.shape == (rows, 48) and got.dtype == x.dtype
    err = relative_error(got, kernels.Reference(codes)(x))
    assert err < W4A8_TOL, err
    # each row is computed on its own: a row gives the same result alone or in a batch
    torch.testing.assert_close(layer(x[-1:]), got[-1:])
    assert relative_error(layer(x.bfloat16()), got) < W4A8_TOL  # bf16 in, bf16 out


both_isas = pytest.mark.skipif(  # the hardware: an AVX2-only CPU is one lowbit supports
    {"avx512", "avx2"} - set(cpu_ext.supported()),
    reason="needs a CPU that runs both ISAs (AVX-512 VNNI and AVX2)",
)


@built
@both_isas
@pytest.mark.parametrize("fmt", W4A8_FORMATS)
def test_avx2_and_avx512_w4a8_agree(fmt):
    # the same packed bytes, quantized activations and integer dot products: the two ISAs
    # differ at most by float summation order (per-channel groups: AVX2 scales per 4 blocks)
    _, codes = _codes(fmt, (64, 1024))
    packed, scale, zero = cpu_w4a8.pack(codes)
    x = torch.randn(7, 1024)  # a full pass of rows and a second one
    runs = cpu_ext.supported()
    got = {isa: cpu_w4a8.matmul(x, packed, scale, zero, codes.group_len, isa) for isa in runs}
    scale = got["avx512"].abs().max().item()
    torch.testing.assert_close(got["avx2"], got["avx512"], rtol=1e-5, atol=1e-5 * scale)
    if "avx512gfni" in runs:  # the same kernels, fields moved by another instruction: bit for bit
        assert torch.equal(got["avx512gfni"], got["avx512"])


@built
@pytest.mark.skipif("avx512gfni" not in cpu_ext.supported(), reason="needs a CPU with GFNI")
def test_avx512gfni_runs_avx512s_other_kernels():
    from pipeline.runtime import cpu_lut16

    ext, x, w, norm = cpu_ext.loaded(), torch.randn(3, 384), torch.randn(40, 384), torch.randn(384)
    _, codes = _codes("exp4g128", (48, 384))
    lut = cpu_lut16.pack(codes)
    calls = {
        "lut16": lambda isa: ext.lut16_mm(x, *lut, codes.group_len, isa),
        "f32 rows": lambda isa: ext.f32_rows_mm(x, w, isa),
        "rms norm": lambda isa: ext.add_rms_norm(x, None, norm, 1e-6, isa),
        "silu mul": lambda isa: ext.silu_mul(x, isa),
    }
    for name, call in calls.items():
        assert torch.equal(call("avx512gfni"), call("avx512")), name


@built
@both_isas
def test_avx2_and_avx512_f32_rows_agree():
    w, x = torch.randn(1030, 1031), torch.randn(7, 1031)  # n and k tails, two passes of rows
    got = {isa: cpu_ext.loaded().f32_rows_mm(x, w, isa) for isa in ("avx512", "avx2")}
    torch.testing.assert_close(got["avx2"], got["avx512"], rtol=1e-5, atol=1e-4)


def test_choose_isa_from_the_cpu_flags_and_lowbit_cpu_isa():
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    avx2 = {"avx2", "fma", "f16c", "avx_vnni"}
    assert cpu_ext.supported(avx512) == ("avx512", "avx2")
    assert cpu_ext.choose_isa("auto", avx512) == "avx512"
    assert cpu_ext.supported(avx512 | {"gfni"}) == ("avx512gfni", "avx512", "avx2")
    assert cpu_ext.choose_isa("auto", avx512 | {"gfni"}) == "avx512gfni"
    with pytest.raises(ValueError, match="lacks gfni.*avx512 or avx2 or none"):
        cpu_ext.choose_isa("avx512gfni", avx512)
    assert cpu_ext.choose_isa("AVX2", avx512) == "avx2"  # the portable path on a big CPU
    assert cpu_ext.choose_isa("", avx2) == "avx2"
    assert cpu_ext.choose_isa("none", avx512) is None
    assert cpu_ext.choose_isa("auto", {"sse4_2", "avx"}) is None  # torch's kernels
    with pytest.raises(ValueError, match="lacks avx512f, avx512bw.*LOWBIT_CPU_ISA.*avx2 or none"):
        cpu_ext.choose_isa("avx512", avx2)
    with pytest.raises(ValueError, match="choose one of auto, avx512gfni, avx512, avx2, none"):
        cpu_ext.choose_isa("avx10", avx512)


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh process (the ISA and the build are chosen once per process)."""
    return subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


@needs("kernels", None if "avx2" in cpu_ext.supported() else NO_ISA)
@built
@pytest.mark.parametrize(("env", "want"), [("avx2", "avx2 w4a8pack w8a8pack avx2 avx2"),
                                           ("none", "None int4pack int8pack - -")])  # fmt: skip
def test_lowbit_cpu_isa_picks_the_path(env, want):
    script = (
        "import torch\n"
        "from pipeline import cpu_ext\n"
        "from pipeline.runtime import float_rows\n"
        "from pipeline.quant.rtn import quantize_rtn\n"
        "from pipeline.runtime.inmemory import linear_codes\n"
        "from pipeline.runtime.kernels import build, int_kernel_name\n"
        "lm = float_rows.convert(torch.nn.Sequential(torch.nn.Linear(1024, 1024)))\n"
        "layer = build(linear_codes('l', quantize_rtn(torch.randn(64, 256), 'int4g128')))\n"
        "print(cpu_ext.isa(), int_kernel_name(), int_kernel_name(bits=8),\n"
        "      getattr(layer, 'isa', '-'), getattr(lm[0], 'isa', '-'))\n"
    )
    proc = _run(script, LOWBIT_CPU_ISA=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == want.split()


@needs_kernels
def test_w4a8_refuses_a_partial_group_and_int4pack_takes_it():
    # k = 224 with groups of 64: the last group is partial, which lowbit's kernel's per-group
    # zero term does not cover; int4pack's 32-column blocks do
    qt, codes = _codes("int4g64", (64, 224))
    assert not cpu_w4a8.fits(codes)
    layer = build(codes)
    assert layer.name == "int4pack"
    x = torch.randn(2, 224)
    assert relative_error(layer(x), x @ qt.dequantize().T) < 1e-2


@needs("kernels", None if cpu_ext.supported() else NO_ISA)
def test_without_a_compiler_int_layers_keep_int4pack_and_float_ones_f_linear(tmp_path):
    # a fresh process (the build is cached per process) whose compiler does not exist
    script = (
        "import logging, torch\n"
        "logging.basicConfig()\n"
        "from pipeline import cpu_ext\n"
        "from pipeline.runtime import float_rows\n"
        "from pipeline.runtime.kernels import int_kernel_name\n"
        "lm = torch.nn.Sequential(torch.nn.Linear(1024, 1024))\n"
        "float_rows.convert(lm)\n"
        "print(cpu_ext.extension() is None, int_kernel_name(), type(lm[0]).__name__)\n"
    )
    env = {"CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    proc = _run(script, LOWBIT_CPU_ISA="auto", **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "int4pack", "Linear"]  # float layers stay F.linear
    assert proc.stderr.count("CPU kernels did not build") == 1  # one warning, not per call


@built
def test_a_lock_left_by_a_killed_build_does_not_stall_the_next_load(tmp_path):
    # torch's build lock outlives a killed build; without lowbit's flock every load waited forever
    import shutil

    from torch.utils.cpp_extension import _get_build_directory

    build = tmp_path / cpu_ext.NAME
    shutil.copytree(_get_build_directory(cpu_ext.NAME, verbose=False), build)  # mtimes kept
    (build / "lock").touch()
    script = (
        "import logging\n"
        "logging.basicConfig()\n"
        "from pipeline import cpu_ext\n"
        "print(cpu_ext.loaded() is not None)\n"
    )
    proc = _run(script, TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True"] and "stale build lock" in proc.stderr
    assert not (build / "lock").exists()
