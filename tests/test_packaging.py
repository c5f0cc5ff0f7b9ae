"""The wheel is what users install: it must carry the config tree, and the CLI must find it. The
image is built from the same sources on the torch and the extras CI tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

# What the wheel is built from (as the Dockerfile copies it).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "pipeline", "conf")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, " ".join(map(str, cmd)) + "\n" + proc.stdout + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of a copy of the sources, offline, with this environment's setuptools."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*pip, "-q", "-w", str(tmp / "dist"), str(src)])
    (built,) = (tmp / "dist").glob("lowbit-*.whl")
    return built


def test_the_wheel_carries_the_whole_config_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "pipeline/conf/" + p.relative_to(REPO / "conf").as_posix()
        for p in (REPO / "conf").rglob("*")
        if p.suffix in (".yaml", ".json")
    }
    assert "pipeline/conf/config.yaml" in expected
    # the CPU kernels' sources and headers, compiled at first use
    csrc = REPO / "pipeline" / "csrc"
    expected |= {f"pipeline/csrc/{p.name}" for p in csrc.iterdir()}
    assert "pipeline/csrc/w4a8.h" in expected
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith(("conf/", "tests/")) for n in names)  # nothing outside the package


def test_the_wheel_declares_its_license_and_the_kernel_build_tool(wheel):
    z = zipfile.ZipFile(wheel)
    (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    fields = z.read(metadata).decode().split("\n\n")[0].splitlines()  # the header, not the README
    assert "License-Expression: Apache-2.0" in fields
    assert "License-File: LICENSE" in fields
    assert metadata.replace("METADATA", "licenses/LICENSE") in z.namelist()
    requires = [Requirement(f.split(": ", 1)[1]) for f in fields if f.startswith("Requires-Dist:")]
    # the runtime's CPU kernels are compiled at first use, with ninja (pipeline/cpu_ext.py)
    assert any(r.name == "ninja" and r.marker is None for r in requires)


@pytest.mark.slow
def test_an_installed_wheel_runs_from_any_directory_without_lowbit_conf(wheel, tmp_path):
    """A fresh venv with the wheel installed, offline: `lowbit --cfg job` composes from the
    packaged tree. The venv sees this environment's dependencies through a .pth file (a line in
    a .pth adds a path but runs none of that path's own .pth files, so the checkout's editable
    install stays out of it)."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    (Path(site.stdout.strip()) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOWBIT_CONF", "PYTHONPATH")}
    where = _run(
        [str(python), "-c", "import pipeline; print(pipeline.__file__)"], cwd=elsewhere, env=env
    )
    assert where.stdout.startswith(str(venv))  # the installed copy, not the checkout
    proc = _run(
        [str(venv / "bin" / "lowbit"), "--cfg", "job", "quant=w2g64", "experiment=smoke"],
        cwd=elsewhere,
        env=env,
    )
    assert "- int2g64" in proc.stdout and "name: smoke" in proc.stdout
    assert list(elsewhere.iterdir()) == []  # --cfg writes nothing


def test_the_constraints_pin_every_dependency_within_its_range():
    """constraints.txt is what CI and the image install: each dependency and extra of
    pyproject.toml pinned to a release its range allows (torch is the platform's)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pinned = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = version
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        wanted += [Requirement(r) for r in extra if not r.startswith("lowbit[")]
    python = "# python {}.{}".format(*sys.version_info)
    if python not in lines:
        pytest.skip(f"constraints.txt is for another Python than {python[2:]} (.ci/setup skips it)")
    for req in wanted:
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in pinned
            continue
        assert name in pinned, f"{req.name} is not in constraints.txt: bash .ci/freeze"
        assert req.specifier.contains(pinned[name], prereleases=True), (req, pinned[name])


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _dockerfile_arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    return value


def test_the_license_file_is_the_one_pyproject_names():
    project = _project()
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert re.search(r"^   Copyright \d{4} the lowbit authors$", text, re.M)


def test_the_image_builds_on_the_torch_ci_tests():
    """.ci/setup's torch pin is the single source; the default base image follows it (the tag
    is pytorch's naming: <torch>-cuda<X.Y>-cudnn<N>-runtime)."""
    (ci_torch,) = re.findall(r"LOWBIT_TORCH_VERSION:-([0-9.]+)\}", (REPO / ".ci/setup").read_text())
    base = _dockerfile_arg("BASE_IMAGE")
    tag = re.fullmatch(r"pytorch/pytorch:([0-9.]+)-cuda[0-9.]+-cudnn[0-9]+-runtime", base)
    assert tag, f"BASE_IMAGE={base} is not a pytorch/pytorch runtime tag"
    assert tag.group(1) == ci_torch, (
        f"Dockerfile builds on torch {tag.group(1)}, CI tests {ci_torch}"
    )


def test_the_image_installs_every_extra_ci_tests():
    """The extras .ci/setup installs (`.[dev]`, expanded) but the test tools, each a real extra
    (pip only warns about an unknown one)."""
    optional = _project()["optional-dependencies"]

    def expand(extra: str) -> set[str]:
        out = set()
        for req in map(Requirement, optional[extra]):
            if canonicalize_name(req.name) == "lowbit":
                for sub in req.extras:
                    out |= {sub} | expand(sub)
        return out

    (ci_extra,) = re.findall(r'-e "\.\[([\w-]+)\]"', (REPO / ".ci/setup").read_text())
    tested = expand(ci_extra) - {"test"}
    assert {"compressed-tensors", "eval", "deepspeed", "slurm"} <= tested
    image = set(_dockerfile_arg("LOWBIT_EXTRAS").split(","))
    assert tested <= image, f"LOWBIT_EXTRAS lacks {sorted(tested - image)}"
    assert image <= set(optional), f"not extras of lowbit: {sorted(image - set(optional))}"


def test_the_image_gets_every_file_the_wheel_is_built_from():
    """Each source is copied by the Dockerfile and let through by .dockerignore (else `docker
    build` fails, or builds a package without its license)."""
    copied = set()
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied |= {w.rstrip("/") for w in line.split()[1:-1] if not w.startswith("--")}
    assert set(SOURCES) <= copied, sorted(set(SOURCES) - copied)
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert set(SOURCES) <= allowed, sorted(set(SOURCES) - allowed)
