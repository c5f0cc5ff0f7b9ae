"""The speculative tests' tiny Llama pairs, for the acceptance evaluator's tests."""

from tests.speculative.conftest import _one_thread, stranger, target  # noqa: F401
