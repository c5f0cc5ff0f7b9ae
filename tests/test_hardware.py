"""Precision by capability: bf16 where the device computes it natively, fp32 elsewhere; a
user's explicit choice kept, with one warning where it will be emulated."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline import hardware

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16"}
AMX = AVX2 | {"avx512f", "amx_bf16"}
ARM_BF16 = frozenset({"asimd", "bf16"})


@pytest.fixture
def cpu(monkeypatch):
    """Set this process's CPU flags for `hardware`, with a fresh once-only memory."""
    monkeypatch.setattr(hardware, "_said", set())

    def use(flags: frozenset[str]) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)

    return use


@pytest.mark.parametrize(
    ("flags", "want"),
    [(AVX2, "32-true"), (AVX512_BF16, "bf16-mixed"), (AMX, "bf16-mixed"), (ARM_BF16, "bf16-mixed")],
)
def test_auto_is_bf16_only_where_the_cpu_computes_it_natively(cpu, caplog, flags, want):
    cpu(flags)
    caplog.set_level(logging.INFO, logger="pipeline.hardware")
    assert hardware.resolve_precision("auto", "cpu", "trainer.precision") == want
    assert hardware.resolve_precision("auto", "cpu", "stage.bootstrap.precision") == want
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"trainer.precision=auto: {want} on cpu (")
    assert ("has no avx512_bf16" in lines[0]) == (flags == AVX2)  # the reason is given


def test_an_explicit_bf16_is_kept_and_warned_once_where_emulated(cpu, caplog):
    cpu(AVX2)
    caplog.set_level(logging.INFO, logger="pipeline.hardware")
    for _ in range(3):
        assert hardware.resolve_precision("bf16-mixed", "cpu", "trainer.precision") == "bf16-mixed"
    assert hardware.resolve_precision("bf16-true", "cpu", "x") == "bf16-true"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "trainer.precision=bf16-mixed will be emulated on cpu" in warnings[0].getMessage()
    assert "set trainer.precision=auto or 32-true" in warnings[0].getMessage()
    # fp32 and a native bf16 say nothing
    caplog.clear()
    assert hardware.resolve_precision("32-true", "cpu", "trainer.precision") == "32-true"
    cpu(AVX512_BF16)
    assert hardware.resolve_precision("bf16-mixed", "cpu", "trainer.precision") == "bf16-mixed"
    assert caplog.records == []


def test_fp16_on_a_cpu_needs_its_own_flags(cpu, caplog):
    cpu(AVX512_BF16)
    caplog.set_level(logging.WARNING, logger="pipeline.hardware")
    hardware.resolve_precision("16-mixed", "cpu", "trainer.precision")
    assert "avx512_fp16" in caplog.records[0].getMessage()


def test_a_loaded_half_model_runs_in_float32_where_half_is_emulated(cpu):
    cpu(AVX2)
    assert hardware.compute_dtype(torch.bfloat16, "cpu", "model.dtype=auto") is torch.float32
    assert hardware.compute_dtype(torch.float32, "cpu", "model.dtype=auto") is torch.float32
    cpu(AVX512_BF16)
    assert hardware.compute_dtype(torch.bfloat16, "cpu", "model.dtype=auto") is torch.bfloat16


def test_accelerator_names_map_to_device_types():
    assert hardware.device_type("gpu") == hardware.device_type("cuda") == "cuda"
    assert hardware.device_type("npu") == "npu" and hardware.device_type("cpu") == "cpu"
    assert hardware.device_type("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_this_machine_is_read_from_its_cpuinfo(monkeypatch):
    monkeypatch.delenv(hardware.ISA_ENV, raising=False)  # the flags as the CPU has them
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = hardware.cpu_flags()
    if "flags" in text:  # x86 Linux: the flags line of the first processor
        first = next(line for line in text.splitlines() if line.startswith("flags"))
        assert flags == frozenset(first.partition(":")[2].split())
    summary = hardware.cpu_summary()
    assert summary["cpu"] and summary["cores"] >= 1
    if "cpu family" in text:  # x86: family/model tell generations apart behind one VM name
        fam, model = (
            re.search(rf"^{k}\s*:\s*(\d+)", text, re.M)[1] for k in ("cpu family", "model")
        )
        assert summary["cpu"].endswith(f" {fam}/{model}")
    assert set(summary["cpu_flags"]) == set(hardware.CPU_FLAGS) & flags
    native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert hardware.native(torch.bfloat16, "cpu")[0] == native


def test_lowbit_cpu_isa_avx2_makes_this_machine_choose_as_an_avx2_host(monkeypatch):
    real = hardware.cpu_flags()
    monkeypatch.setenv("LOWBIT_CPU_ISA", "avx2")
    capped = hardware.cpu_flags()
    assert not any(f.startswith(("avx512", "amx")) for f in capped)
    assert capped == {f for f in real if not f.startswith(("avx512", "amx"))}
    if real & {"avx512_bf16", "amx_bf16"}:  # an AVX-512 BF16 machine now trains in fp32
        monkeypatch.setattr(hardware, "_said", set())
        assert hardware.resolve_precision("auto", "cpu", "trainer.precision") == "32-true"


def test_a_bf16_distill_teacher_is_warned_where_emulated(cpu, caplog):
    from pipeline.stages import distill

    caplog.set_level(logging.WARNING, logger="pipeline.hardware")
    run = SimpleNamespace(trainer={"accelerator": "cpu"})
    cpu(AVX2)
    distill.check(distill.DistillConfig(teacher_dtype="bfloat16"), run)
    assert "stage.distill.teacher_dtype=bfloat16 will be emulated on cpu" in caplog.text
    caplog.clear()
    distill.check(distill.DistillConfig(), run)  # float32: nothing to say
    cpu(AVX512_BF16)
    distill.check(distill.DistillConfig(teacher_dtype="bfloat16"), run)
    assert caplog.records == []
