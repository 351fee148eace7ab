"""The model runner a config asks for: the generation runner or the pooling runner."""

from __future__ import annotations

from triollm.config import EngineConfig
from triollm.step import ModelRunner

__all__ = ["create_runner"]


def create_runner(config: EngineConfig) -> ModelRunner:
    """Load the model (in the calling thread) into the runner for ``config.model.runner``
    (over ``tensor_parallel_size`` ranks: model/parallel/)."""
    if config.model.runner == "pooling":
        from triollm.model.runners.pooling_runner import PoolingModelRunner

        return PoolingModelRunner(config)
    if config.parallel.tensor_parallel_size > 1:
        from triollm.model.parallel.runner import TensorParallelRunner

        return TensorParallelRunner(config)
    from triollm.model.runners.torch_runner import TorchModelRunner

    return TorchModelRunner(config)
