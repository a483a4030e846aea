"""The engine's LoRA adapters: names known to the server, and an LRU of those resident.

A name is *registered* (name -> folder) by the config or at runtime; it is *resident*
(weights on the device) from its first use until evicted. At most `max_loras` are
resident; making room evicts the least recently used adapter that no unfinished sequence
holds (a running request keeps its adapter's weights: `acquire`/`release`). A request for
an adapter that is not resident while all `max_loras` resident ones are in use is refused
with `EngineOverloadedError` (429 + Retry-After: it fits once one of them is done), so the
adapters in memory never exceed `max_loras`; registering (`load`) is never refused.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from modelship.engine.errors import EngineOverloadedError
from modelship.model.lora import LoRAAdapter, LoRAError

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(
        self, num_layers: int, dtype: torch.dtype, device: torch.device, max_loras: int
    ) -> None:
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.max_loras = max_loras
        self.paths: dict[str, Path] = {}
        self.resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU first
        self.in_use: dict[str, int] = {}  # adapter key -> unfinished sequences holding it
        self.num_loads = 0
        self.num_evictions = 0

    def names(self) -> list[str]:
        return list(self.paths)

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Register `name` and load it now (validating the folder); replaces an adapter of
        the same name for new requests (running ones keep the weights they started with)."""
        if not name or name != name.strip():
            raise LoRAError(f"LoRA adapter name {name!r} is not valid")
        adapter = LoRAAdapter.load(name, path, self.num_layers, self.dtype, self.device)
        self.paths[name] = Path(path)
        self.resident.pop(name, None)
        self._admit(adapter)
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.paths:
            raise KeyError(name)
        del self.paths[name]
        self.resident.pop(name, None)

    def get(self, name: str) -> LoRAAdapter:
        """The resident adapter `name` (loaded from its folder if evicted); KeyError if the
        name is not registered."""
        adapter = self.resident.get(name)
        if adapter is not None:
            self.resident.move_to_end(name)
            return adapter
        if len(self.resident) >= self.max_loras and all(
            resident.key in self.in_use for resident in self.resident.values()
        ):
            raise EngineOverloadedError(
                f"all {self.max_loras} resident LoRA adapters are in use (max_loras); "
                f"`{name}` fits once one of their requests ends"
            )
        adapter = LoRAAdapter.load(name, self.paths[name], self.num_layers, self.dtype, self.device)
        self._admit(adapter)
        return adapter

    def acquire(self, adapter: LoRAAdapter) -> None:
        self.in_use[adapter.key] = self.in_use.get(adapter.key, 0) + 1

    def release(self, adapter: LoRAAdapter) -> None:
        count = self.in_use.get(adapter.key, 0) - 1
        if count > 0:
            self.in_use[adapter.key] = count
        else:
            self.in_use.pop(adapter.key, None)

    def _admit(self, adapter: LoRAAdapter) -> None:
        self.num_loads += 1
        for name in list(self.resident):
            if len(self.resident) < self.max_loras:
                break
            if self.resident[name].key not in self.in_use:
                del self.resident[name]
                self.num_evictions += 1
                logger.info("LoRA adapter %s evicted (least recently used)", name)
        self.resident[adapter.name] = adapter
