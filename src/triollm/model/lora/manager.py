"""Which LoRA adapters are loaded, which sit in the model's slots, and the per-token
mask of a step. Owned by the model runner, used from the model thread only.

Two tiers, as in vLLM: up to ``max_cpu_loras`` adapters loaded in host memory (least
recently used dropped first; a request whose adapter was dropped has it read again from
its path), and ``max_loras`` slots in the model's ``LoRALinear`` layers. The scheduler
never puts more than ``max_loras`` adapters in one step, so a step's adapters always
fit: one that is not resident takes a free slot, or the slot of the least recently used
adapter the step does not need.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from triollm.config import LoRAConfig
from triollm.errors import LoRAAdapterError
from triollm.lora.request import LoRARequest
from triollm.model.lora.adapter import LayerShape, LoRAAdapter, load_adapter
from triollm.model.lora.layers import LoRALinear, LoRAStep, adaptable_layers, group_shared_inputs

__all__ = ["LoRAManager"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoRAManager:
    """Wraps the model's adaptable layers (once, at start-up) and keeps the adapters."""

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.step = LoRAStep()
        self.layers: dict[str, LoRALinear] = {}
        for name, (module, in_features, out_features) in adaptable_layers(
                model, config.target_modules).items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            wrapped = LoRALinear(module, in_features, out_features, max_loras=config.max_loras,
                                 max_rank=config.max_lora_rank, dtype=config.lora_dtype,
                                 device=device, step=self.step)
            setattr(parent, child, wrapped)
            self.layers[name] = wrapped
        if not self.layers:
            wanted = config.target_modules or "any"
            raise ValueError(f"lora_target_modules: the model has no linear layer named "
                             f"{wanted} to adapt")
        self.shapes = {name: LayerShape(layer.in_features, layer.out_features)
                       for name, layer in self.layers.items()}
        #: Loaded adapters by id, least recently used first.
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        #: The adapter id in each slot (None: free), and slots by adapter id, least
        #: recently used first.
        self._slots: list[int | None] = [None] * config.max_loras
        self._resident: OrderedDict[int, int] = OrderedDict()
        logger.info("LoRA: %d layers take adapters (%d slots of rank %d, %s)",
                    len(self.layers), config.max_loras, config.max_lora_rank,
                    config.lora_dtype)

    # -- adapters in host memory ---------------------------------------------------

    def add(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter (checked against the model; ``LoRAAdapterError``
        says what does not fit). Returns False if it was loaded already (unless
        ``load_inplace``, which reads it again)."""
        lora_id = request.lora_int_id
        if lora_id in self._loaded and not request.load_inplace:
            self._loaded.move_to_end(lora_id)
            return False
        adapter = load_adapter(request, self.shapes, max_rank=self.config.max_lora_rank,
                               dtype=self.config.lora_dtype)
        self._loaded[lora_id] = adapter
        self._loaded.move_to_end(lora_id)
        slot = self._resident.get(lora_id)
        if slot is not None:  # reloaded in place: its slot gets the new weights
            self._fill(slot, adapter)
        while len(self._loaded) > self.config.max_cpu_loras:
            dropped, _ = self._loaded.popitem(last=False)
            logger.info("LoRA adapter %d dropped from host memory (max_cpu_loras=%d)",
                        dropped, self.config.max_cpu_loras)
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (its slot is freed); False if it was not loaded."""
        slot = self._resident.pop(lora_id, None)
        if slot is not None:
            self._slots[slot] = None
        return self._loaded.pop(lora_id, None) is not None

    def loaded_ids(self) -> set[int]:
        return set(self._loaded) | set(self._resident)

    # -- the step ------------------------------------------------------------------

    def begin_step(self, adapters: list[LoRARequest | None], num_tokens: list[int]
                   ) -> dict[int, str]:
        """Make the step's adapters resident and set the mask for its tokens:
        ``adapters[i]`` runs ``num_tokens[i]`` consecutive tokens (None: the base model).
        Returns the adapters that could not be loaded, with why; the caller fails their
        requests and calls again without them."""
        wanted: dict[int, LoRARequest] = {}
        for request in adapters:
            if request is not None:
                wanted.setdefault(request.lora_int_id, request)
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters; max_loras is "
                               f"{self.config.max_loras}")
        for lora_id in wanted:  # loading one must not drop another this step needs
            if lora_id in self._loaded:
                self._loaded.move_to_end(lora_id)
        failed: dict[int, str] = {}
        for lora_id, request in wanted.items():
            if lora_id not in self._loaded and lora_id not in self._resident:
                try:
                    self.add(request)
                except LoRAAdapterError as error:
                    failed[lora_id] = str(error)
        if failed:
            return failed
        slot_of = {lora_id: self._make_resident(lora_id, set(wanted)) for lora_id in wanted}
        if not slot_of:
            self.step.mask = None
            return {}
        token_slots = torch.tensor(
            [-1 if request is None else slot_of[request.lora_int_id]
             for request in adapters], dtype=torch.long)
        token_slots = token_slots.repeat_interleave(torch.tensor(num_tokens))
        rank = self.config.max_lora_rank
        column_slots = torch.arange(self.config.max_loras * rank) // rank
        mask = (token_slots[:, None] == column_slots[None, :]).to(self.config.lora_dtype)
        self.step.mask = mask.to(self.device)
        return {}

    def end_step(self) -> None:
        self.step.mask = None
        for group in {layer.group for layer in self.layers.values()}:
            group.clear()

    def calibrate(self, forward: Callable[[], T]) -> T:
        """Run ``forward`` (a forward of the model) once, watching which layers read
        the same input, and group them; returns what ``forward`` returns."""
        self.step.recording = []
        try:
            result = forward()
            groups = group_shared_inputs(self.step.recording)
        finally:
            self.step.recording = None
        names = {id(layer): name.rsplit(".", 1)[-1] for name, layer in self.layers.items()}
        logger.info("LoRA: %d groups of layers share their input (%s)", len(groups),
                    ", ".join(sorted({"+".join(names[id(m)] for m in g.members)
                                      for g in groups})) or "none")
        return result

    def _make_resident(self, lora_id: int, needed: set[int]) -> int:
        slot = self._resident.get(lora_id)
        if slot is not None:
            self._resident.move_to_end(lora_id)
            return slot
        free = [index for index, held in enumerate(self._slots) if held is None]
        if free:
            slot = free[0]
        else:
            victim = next(held for held in self._resident if held not in needed)
            slot = self._resident.pop(victim)
        self._slots[slot] = lora_id
        self._resident[lora_id] = slot
        self._loaded.move_to_end(lora_id)
        self._fill(slot, self._loaded[lora_id])
        return slot

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, layer in self.layers.items():
            pair = adapter.weights.get(name)
            layer.set_slot(slot, *(pair if pair is not None else (None, None)))

