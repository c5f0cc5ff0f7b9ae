"""Skips that CI turns into failures.

A test whose subsystem is missing on this machine (no Slurm, no compiled CPU kernels, an optional
package not installed) skips and says why, so the suite runs anywhere. CI, which claims to test
every subsystem, sets ``LOWBIT_REQUIRE`` (a comma list of the names below; ``.ci/run`` sets all
of them), and the same test then fails with one line naming the subsystem and the fix: a broken
install cannot pass as a green run with a few more skips.

Two ways in, one rule (:func:`require`):

- at run time, where the test or fixture finds out: ``require("slurm", reason)``;
- at collection, as a mark: ``@needs("kernels", why_missing)`` (no reason: present), or
  ``@needs("deepspeed")`` for a package, which is imported when the test is set up.
"""

from __future__ import annotations

import importlib
import os
from typing import NoReturn

import pytest

ENV = "LOWBIT_REQUIRE"
SUBSYSTEMS = ("slurm", "kernels", "deepspeed", "compressed-tensors", "lm-eval")
# What brings each back, added to the reason; Slurm's reasons name their own (install, root, key).
FIXES = {
    "kernels": "they need AVX2 and g++ with ninja (`bash .ci/setup` builds them)",
    "deepspeed": "pip install -e '.[deepspeed]'",
    "compressed-tensors": "pip install -e '.[compressed-tensors]'",
    "lm-eval": "pip install -e '.[eval]'",
}
# The packages behind the optional extras: present means importable.
MODULES = {
    "deepspeed": "deepspeed",
    "compressed-tensors": "compressed_tensors",
    "lm-eval": "lm_eval",
}


def required() -> frozenset[str]:
    """The subsystems ``LOWBIT_REQUIRE`` names (an unknown name is a usage error, not ignored)."""
    names = {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    unknown = sorted(names - set(SUBSYSTEMS))
    if unknown:
        choices = ", ".join(SUBSYSTEMS)
        raise pytest.UsageError(f"{ENV}: unknown {', '.join(unknown)}; choose from {choices}")
    return frozenset(names)


def _known(name: str) -> None:
    if name not in SUBSYSTEMS:
        raise ValueError(f"unknown subsystem {name!r}; add it to SUBSYSTEMS in {__name__}")


def require(name: str, reason: str) -> NoReturn:
    """Skip the current test because subsystem ``name`` is missing, or fail it when
    ``LOWBIT_REQUIRE`` names ``name``.

    Args:
        name: One of :data:`SUBSYSTEMS`.
        reason: What is missing; the message adds the subsystem's fix (:data:`FIXES`).
    """
    __tracebackhide__ = True  # a skip is reported at the caller's line
    _known(name)
    message = f"{reason}; {FIXES[name]}" if name in FIXES else reason
    if name in required():
        pytest.fail(f"{ENV} includes {name}, but {message}", pytrace=False)
    pytest.skip(message)


def needs(name: str, missing: str | None = None) -> pytest.MarkDecorator:
    """Mark a test (or a parameter) as needing subsystem ``name``.

    Args:
        name: One of :data:`SUBSYSTEMS`.
        missing: Why it is missing, where the caller found out at collection; None for present.
            A package subsystem (:data:`MODULES`) is checked by importing it at set-up, so a
            package that is found but fails to import (a broken install) counts as missing.
    """
    _known(name)
    return pytest.mark.requires(name, missing)


def check(name: str, missing: str | None) -> None:
    """Set-up of a test marked :func:`needs`: :func:`require` unless the subsystem is here."""
    if missing is not None:
        require(name, missing)
    if name in MODULES:
        try:
            importlib.import_module(MODULES[name])
        except ImportError as e:
            require(name, f"{MODULES[name]} does not import ({type(e).__name__}: {e})")
