"""CI requires what it claims to test: with a subsystem removed, a test of it fails under
LOWBIT_REQUIRE with one line naming the subsystem, where a developer's run skips it.

Each removal runs one test of that subsystem in a pytest of its own, on a machine where the
subsystem is otherwise present: a broken `sinfo` first on PATH, LOWBIT_CPU_ISA=none, a package
shadowed by one whose import fails. The test fails at set-up, before any of its fixtures start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline import cpu_ext
from tests import _require
from tests.conftest import REPO

# A package that is found but does not import, as a half-removed install leaves it.
SHADOW = "raise ImportError('{module} removed for this test')\n"
# One test per subsystem; any would do, as the failure comes before its fixtures.
CASES = {
    "slurm": "tests/cluster/test_slurm_fixture.py::test_node_is_idle_with_all_cpus",
    "kernels": (
        "tests/runtime/test_kernels.py::test_w4a8_refuses_a_partial_group_and_int4pack_takes_it"
    ),
    "deepspeed": "tests/lit/test_deepspeed_cpu.py::test_loads_the_shipped_configs",
    "compressed-tensors": (
        "tests/export/test_compressed_tensors.py::test_decompressing_gives_the_same_weights"
    ),
    "lm-eval": "tests/evaluation/test_harness.py::test_config_is_validated_on_entry",
}
# What each failure line says is missing (also where this machine lacks Slurm or AVX2 itself).
WHY = {
    "slurm": "Slurm/munge",
    "kernels": "LOWBIT_CPU_ISA=none" if cpu_ext.supported() else "neither AVX2",
    **{name: "removed for this test" for name in _require.MODULES},
}


def removed(name: str, tmp_path) -> dict[str, str]:
    """The environment of a pytest run on this machine with subsystem ``name`` taken away."""
    env = {**os.environ, _require.ENV: name}
    if name == "slurm":
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        sinfo = bin_dir / "sinfo"
        sinfo.write_text(
            "#!/bin/sh\necho 'sinfo: error while loading shared libraries' >&2\nexit 127\n"
        )
        sinfo.chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    elif name == "kernels":
        env["LOWBIT_CPU_ISA"] = "none"
    else:
        module = _require.MODULES[name]
        (tmp_path / "shadow" / module).mkdir(parents=True)
        (tmp_path / "shadow" / module / "__init__.py").write_text(SHADOW.format(module=module))
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tmp_path / "shadow"), env.get("PYTHONPATH")])
        )
    return env


def run_pytest(nodeid: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", nodeid, "-q", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_removing_a_required_subsystem_fails_with_a_line_naming_it(name, tmp_path):
    proc = run_pytest(CASES[name], removed(name, tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    # pytest prints a set-up failure's message as it is, one line (pytrace=False)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"LOWBIT_REQUIRE includes {name}, ")]
    assert len(lines) == 1 and WHY[name] in lines[0], out[-3000:]
    assert f"ERROR {CASES[name]}" in out  # at set-up
    assert " passed" not in out and " skipped" not in out


def test_every_subsystem_ci_requires_has_a_case():
    ci_run = (REPO / ".ci" / "run").read_text()
    (line,) = [ln for ln in ci_run.splitlines() if ln.startswith(f"export {_require.ENV}=")]
    assert line.split("=", 1)[1].split(",") == list(_require.SUBSYSTEMS) == list(CASES)


def test_require_skips_unless_required_then_fails_naming_the_fix(monkeypatch):
    monkeypatch.delenv(_require.ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"no deepspeed; pip install -e '\.\[deepspeed"):
        _require.require("deepspeed", "no deepspeed")
    monkeypatch.setenv(_require.ENV, " kernels , deepspeed")
    with pytest.raises(pytest.fail.Exception) as failed:
        _require.require("deepspeed", "no deepspeed")
    assert str(failed.value) == (
        "LOWBIT_REQUIRE includes deepspeed, but no deepspeed; pip install -e '.[deepspeed]'"
    )
    with pytest.raises(pytest.skip.Exception):  # what is not named still skips
        _require.require("slurm", "no Slurm")


def test_unknown_names_are_refused_not_ignored(monkeypatch):
    monkeypatch.setenv(_require.ENV, "slurm,kernel")
    with pytest.raises(pytest.UsageError, match="unknown kernel; choose from slurm, kernels"):
        _require.required()
    with pytest.raises(ValueError, match="unknown subsystem 'gpu'"):
        _require.needs("gpu")


def test_a_package_that_does_not_import_counts_as_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import raises ImportError
    monkeypatch.setenv(_require.ENV, "lm-eval")
    with pytest.raises(pytest.fail.Exception, match="lm_eval does not import"):
        _require.check("lm-eval", None)
    _require.check("kernels", None)  # present: nothing happens


def test_slurm_check_exits_1_when_the_tools_are_missing(tmp_path):
    proc = subprocess.run(
        ["/bin/bash", str(REPO / ".ci" / "slurm.sh"), "check"],
        env={"PATH": str(tmp_path)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and "slurm: missing" in proc.stdout and "sinfo" in proc.stdout
