"""ModelShelf: models load onto the given device when asked for, at most `keep` stay, the
evicted one is really freed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from pipeline.evaluation.perplexity import perplexities
from pipeline.evaluation.shelf import ModelShelf


class Made:
    """Loaders that build a small linear on the device they are given, and remember them."""

    def __init__(self):
        self.alive: weakref.WeakSet = weakref.WeakSet()
        self.devices: list[torch.device] = []
        self.most_alive = 0

    def loader(self):
        def load(device):
            gc.collect()
            model = nn.Linear(4, 4).to(device)
            self.alive.add(model)
            self.devices.append(device)
            self.most_alive = max(self.most_alive, len(self.alive))
            return model

        return load


def shelf(names="abc", keep=1, device="cpu"):
    made = Made()
    return ModelShelf({n: made.loader() for n in names}, torch.device(device), keep), made


def test_one_model_at_a_time_and_the_previous_one_freed():
    models, made = shelf(keep=1)
    first = weakref.ref(models["a"])
    assert models.loaded() == ["a"]
    models["b"]  # noqa: B018
    gc.collect()
    assert first() is None and models.loaded() == ["b"] and len(made.alive) == 1
    assert [n for n in models] == ["a", "b", "c"] and models.loads == ["a", "b"]


def test_keep_two_evicts_the_least_recently_used():
    models, made = shelf(keep=2)
    models["a"], models["b"], models["a"]  # noqa: B018  (a is now the most recent)
    models["c"]  # noqa: B018
    assert models.loaded() == ["a", "c"]
    assert models.loads == ["a", "b", "c"]  # a was not loaded twice
    models.holding(1)
    assert models.loaded() == ["c"]
    models.clear()
    gc.collect()
    assert models.loaded() == [] and len(made.alive) == 0


def test_membership_and_views_do_not_load():
    models, made = shelf()
    assert "a" in models and "z" not in models and len(models) == 3
    view = models.only(["c", "a"])
    assert list(view) == ["a", "c"] and "b" not in view
    assert made.devices == []  # nothing asked for yet
    view["c"]  # noqa: B018
    assert models.loaded() == ["c"]
    with pytest.raises(KeyError):
        view["b"]  # noqa: B018
    with pytest.raises(KeyError):
        models["z"]  # noqa: B018


def test_models_load_on_the_shelf_device():
    models, made = shelf(device="meta")  # weights that would move, moved without memory
    assert models["a"].weight.device.type == "meta"
    assert made.devices == [torch.device("meta")]


def test_mapped_converts_each_as_it_loads_and_frees_the_source_shelf():
    models, made = shelf(keep=2)
    models["a"]  # noqa: B018
    halves = models.mapped(lambda m: m.half())
    assert models.loaded() == []
    assert halves["b"].weight.dtype == torch.float16 and halves.keep == 2


def test_perplexities_never_hold_two_models():
    class Test:  # the part of a Heldout that perplexities reads
        windows = torch.randint(0, 8, (3, 5))

        def label(self):
            return "test windows"

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 8)

        def forward(self, input_ids):
            return type("Out", (), {"logits": self.embed(input_ids)})()

    made = Made()

    def load(device):
        gc.collect()
        model = Tiny().to(device)
        made.alive.add(model)
        made.most_alive = max(made.most_alive, len(made.alive))
        return model

    models = ModelShelf({n: load for n in "abcd"}, torch.device("cpu"), keep=1)
    ppl = perplexities(models, Test(), batch_size=2)
    assert list(ppl) == list("abcd") and all(p > 1 for p in ppl.values())
    assert made.most_alive == 1
