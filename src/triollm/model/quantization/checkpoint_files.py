"""A checkpoint's safetensors files, one or sharded by ``model.safetensors.index.json``,
read tensor by tensor."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

__all__ = ["CheckpointTensors", "checkpoint_directory"]

_INDEX = "model.safetensors.index.json"


def checkpoint_directory(model: str, *, revision: str | None = None,
                         download_dir: str | None = None) -> Path:
    """``model`` itself where it is a directory; else the hub repository's snapshot with
    its safetensors files, downloaded as ``from_pretrained`` would."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, cache_dir=download_dir,
                                  allow_patterns=["*.safetensors", _INDEX]))


class CheckpointTensors:
    """The tensors of the safetensors checkpoint in ``directory``, by name; each is read
    from its file when asked for. Use as a context manager: it closes the files."""

    def __init__(self, directory: Path) -> None:
        index = directory / _INDEX
        self._file_of: dict[str, Path] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
            self._file_of = {name: directory / file for name, file in weight_map.items()}
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}
        if not self._file_of:
            for path in sorted(directory.glob("*.safetensors")):
                self._file_of.update(dict.fromkeys(self._handle(path).keys(), path))
        if not self._file_of:
            raise FileNotFoundError(f"no safetensors weights in {directory}: triollm reads "
                                    f"quantized checkpoints from safetensors files")

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``; ``KeyError`` where the checkpoint has none."""
        return self._handle(self._file_of[name]).get_tensor(name)

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path]

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
