"""``LoRARequest``: which adapter a request runs with (vLLM's class, at vLLM's module
path). Plain data: no torch, no event loop."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoRARequest"]


@dataclass(eq=False)
class LoRARequest:
    """A PEFT LoRA adapter: ``lora_path`` is a directory (or hub id) with
    ``adapter_config.json`` and its weights; ``lora_int_id`` (>= 1) identifies it inside
    the engine, which holds one adapter per id. Two requests are for the same adapter
    when their ``lora_name`` is the same, as in vLLM."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    #: The served base model the adapter belongs to (``/v1/models``' ``parent``).
    base_model_name: str | None = None
    #: Reload the adapter's weights even if an adapter with this id is loaded.
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: must name the adapter's directory, got "
                             f"{self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
