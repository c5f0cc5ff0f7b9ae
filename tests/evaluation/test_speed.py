"""runtime_speed: every model timed plain and every pair speculatively, on runtime modules."""

from pipeline.evaluation.speed import runtime_speed
from tests.speculative.conftest import tiny_llama


def test_every_model_and_pair_gets_a_row():
    models = {"t": tiny_llama(0), "d": tiny_llama(1)}
    speed = runtime_speed(
        models,
        [("d", "t")],
        [list(range(1, 13))],
        new_tokens=4,
        gamma=2,
        adaptive=None,
        temperature=1.0,
        temperature_schedule=False,
        seed=0,
    )
    assert set(speed["plain"]) == {"t", "d"} and set(speed["speculative"]) == {"d@t"}
    row = speed["speculative"]["d@t"]
    assert row["tokens_per_s"] > 0 and 0 <= row["alpha"] <= 1 and row["gamma"] <= 2
