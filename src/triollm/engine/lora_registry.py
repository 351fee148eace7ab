"""The LoRA adapters an engine serves: which are added, and the version of each one's
weights.

``EngineCore`` owns one ``LoRARegistry``. ``add`` does the whole job in one call (check,
load in the runner, record), so the async engine runs it in the model thread, where the
runner's weights live; each adapter's entry is replaced in one assignment, so the event
loop, which reads (``has``, ``lookup``), sees an adapter whole or not at all. A removal
is ``forget`` on the loop, at once (no request accepted after it names the adapter),
then ``unload`` in the model thread, after the steps queued before it; ``remove`` does
both for a caller that owns the thread.
"""

from __future__ import annotations

from triollm.lora.request import LoRARequest
from triollm.step import LoRAModelRunner, ModelRunner

__all__ = ["LoRARegistry"]


class LoRARegistry:
    """Adapters by id, each with the version of its weights (bumped by a
    ``load_inplace`` reload, so its old prefix-cache blocks are not reused)."""

    def __init__(self, enabled: bool, runner: ModelRunner) -> None:
        self._runner = runner if enabled and isinstance(runner, LoRAModelRunner) else None
        self._adapters: dict[int, tuple[LoRARequest, int]] = {}

    def runner(self) -> LoRAModelRunner:
        """The runner, which serves LoRA adapters; ``ValueError`` without ``enable_lora``."""
        if self._runner is None:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with "
                             "enable_lora=True (--enable-lora)")
        return self._runner

    def add(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in the runner and record it. Raises ``ValueError`` naming what
        does not fit (LoRA not enabled, a rank above ``max_lora_rank``, modules the model
        lacks, an id already used by another adapter). False if it was added already
        (``load_inplace=True`` reads it again)."""
        if not self._needs_load(lora_request):
            return False
        self.runner().add_lora(lora_request)
        lora_id = lora_request.lora_int_id
        known = self._adapters.get(lora_id)
        version = 0 if known is None else known[1] + 1
        self._adapters[lora_id] = (lora_request, version)
        return True

    def remove(self, lora_id: int) -> bool:
        """``forget`` then ``unload``. False if it was not added."""
        removed = self.forget(lora_id)
        self.unload(lora_id)
        return removed

    def forget(self, lora_id: int) -> bool:
        """Take an adapter off the list new requests may name; requests in flight with it
        finish with it. False if it was not added."""
        return self._adapters.pop(lora_id, None) is not None

    def unload(self, lora_id: int) -> None:
        """Drop an adapter's weights from the runner (in the runner's thread)."""
        if self._runner is not None:
            self._runner.remove_lora(lora_id)

    def ids(self) -> set[int]:
        return set(self._adapters)

    def has(self, lora_request: LoRARequest) -> bool:
        """Whether a request may name this adapter without adding it first (it was
        added, under the same id, name and path). ``ValueError`` if it cannot be."""
        self._needs_load(lora_request)
        known = self._adapters.get(lora_request.lora_int_id)
        return known is not None and _same_adapter(known[0], lora_request)

    def lookup(self, lora_request: LoRARequest) -> tuple[LoRARequest, int]:
        """The adapter a request runs with, as it was added, and its weights' version;
        ``ValueError`` if it is not added (or no longer: read once, so a removal in
        another thread cannot land between a check and the read)."""
        self._needs_load(lora_request)
        known = self._adapters.get(lora_request.lora_int_id)
        if known is None or not _same_adapter(known[0], lora_request):
            raise ValueError(f"lora_request: adapter {lora_request.lora_name!r} is not "
                             f"loaded; add_lora() it first")
        return known

    def _needs_load(self, lora_request: LoRARequest) -> bool:
        """Check ``lora_request`` against this engine (``ValueError``); True if the
        runner must load it."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        self.runner()
        known = self._adapters.get(lora_request.lora_int_id)
        if known is None or lora_request.load_inplace:
            return True
        if not _same_adapter(known[0], lora_request):
            raise ValueError(
                f"lora_request: lora_int_id {lora_request.lora_int_id} is adapter "
                f"{known[0].lora_name!r} ({known[0].lora_path}); one id names one adapter "
                f"(pass load_inplace=True to replace it)")
        return False


def _same_adapter(a: LoRARequest, b: LoRARequest) -> bool:
    return (a.lora_name, a.lora_path) == (b.lora_name, b.lora_path)
