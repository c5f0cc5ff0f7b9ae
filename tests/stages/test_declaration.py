"""Every stage declares itself as STAGE = Stage(...), checked when the registry loads it."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from pipeline import stages
from pipeline.stages import ORDER, Stage


@pytest.mark.parametrize("name", ORDER)
def test_every_stage_declares_itself(name):
    decl = stages.load(name)
    assert isinstance(decl, Stage) and decl.problems(name) == []
    assert dataclasses.is_dataclass(decl.config) and callable(decl.run)


def _broken(**change):
    good = stages.load("allocate")
    return dataclasses.replace(good, **change)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"config": dict}, "config is not a dataclass"),
        ({"needs": ("evaluate",)}, "reads 'evaluate', not an earlier stage"),
        ({"uses": ("nosuch",)}, "reads 'nosuch', not an earlier stage"),
        ({"sections": ("model", "optimizer.lr")}, "section 'optimizer.lr' is not one of"),
        ({"check": "not callable"}, "check is not callable"),
    ],
)
def test_a_broken_declaration_fails_when_loaded_naming_what_is_wrong(monkeypatch, change, problem):
    fake = types.ModuleType("pipeline.stages.allocate")
    fake.STAGE = _broken(**change)
    monkeypatch.setitem(sys.modules, "pipeline.stages.allocate", fake)
    with pytest.raises(TypeError, match=f"pipeline.stages.allocate.STAGE: .*{problem}"):
        stages.load("allocate")


def test_a_module_without_a_declaration_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "pipeline.stages.export", types.ModuleType("x"))
    with pytest.raises(TypeError, match=r"must define STAGE = Stage\(...\)"):
        stages.load("export")
