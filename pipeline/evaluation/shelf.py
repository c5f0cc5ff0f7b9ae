"""The run's models by name, each loaded onto the stage's device when a measurement asks for it.

A shelf holds at most ``keep`` models (a 7–70 B target and its variants outgrow one device
together) and frees the least recently used one (del, gc, the device cache) before the next loads.
Callers look models up where they use them, so an evicted model is not kept alive by a name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from pipeline.hardware import release

Loader = Callable[[torch.device], nn.Module]  # loads one model onto the device it is given


class ModelShelf(Mapping[str, nn.Module]):
    """``{name: model}``, each loaded onto ``device`` on first access; at most ``keep`` stay."""

    def __init__(self, loaders: Mapping[str, Loader], device: torch.device, keep: int = 1):
        self.loaders, self.device, self.keep = dict(loaders), torch.device(device), keep
        self._loaded: OrderedDict[str, nn.Module] = OrderedDict()
        self.loads: list[str] = []  # every load in order: what reloads cost

    def __getitem__(self, name: str) -> nn.Module:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        if name not in self.loaders:
            raise KeyError(name)
        while len(self._loaded) >= max(self.keep, 1):
            self._loaded.popitem(last=False)
            release(self.device)
        self._loaded[name] = self.loaders[name](self.device)
        self.loads.append(name)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.loaders)

    def __len__(self) -> int:
        return len(self.loaders)

    def __contains__(self, name: object) -> bool:  # Mapping's would load the model to find out
        return name in self.loaders

    def loaded(self) -> list[str]:
        """The names held now, least recently used first."""
        return list(self._loaded)

    def holding(self, keep: int) -> ModelShelf:
        """This shelf with room for ``keep`` models (fewer: the oldest are freed now)."""
        self.keep = keep
        while len(self._loaded) > max(keep, 1):
            self._loaded.popitem(last=False)
        release(self.device)
        return self

    def clear(self) -> None:
        """Free every loaded model."""
        self._loaded.clear()
        release(self.device)

    def only(self, names: Iterable[str]) -> Mapping[str, nn.Module]:
        """The models in ``names`` (in this shelf's order), loaded through this shelf."""
        return _View(self, [n for n in self.loaders if n in set(names)])

    def mapped(self, fn: Callable[[nn.Module], nn.Module]) -> ModelShelf:
        """A shelf of the same models, each passed through ``fn`` after it loads (this one is
        cleared: the two never hold models at once)."""
        self.clear()

        def wrap(load: Loader) -> Loader:
            return lambda device: fn(load(device))

        return ModelShelf({n: wrap(f) for n, f in self.loaders.items()}, self.device, self.keep)


class _View(Mapping[str, nn.Module]):
    """Some of a shelf's names; lookups go through the shelf, so its limit holds for both."""

    def __init__(self, shelf: ModelShelf, names: list[str]):
        self.shelf, self.names = shelf, names

    def __getitem__(self, name: str) -> nn.Module:
        if name not in self.names:
            raise KeyError(name)
        return self.shelf[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names
