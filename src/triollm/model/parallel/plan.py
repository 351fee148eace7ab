"""A model sharded by transformers' own tensor-parallel plan.

transformers writes, per family, which layer splits how: the config class's
``base_model_tp_plan`` (``layers.*.self_attn.q_proj: colwise``, ``o_proj: rowwise``...)
and the causal LM's ``_tp_plan`` (``lm_head: colwise_gather_output``); a loaded model
holds both, prefixed, in ``model._tp_plan``. triollm reads that plan and slices the
weights itself, before the layers are packed or quantized (``shard_model``), then puts
the collectives on the layers it computes with (``ShardedModel.install``, layers.py).

- ``colwise``: the weight's output rows (and bias) split evenly: whole attention heads,
  whole KV heads, a slice of the MLP's width.
- ``rowwise``: the input columns split; the output summed over the ranks.
- ``colwise_gather_output`` / ``colwise_rep`` on the LM head and ``embedding_rowwise``
  on the token embedding: the vocabulary's rows split (padded to equal shares),
  logits gathered, embeddings summed.
- ``replicated_with_grad_allreduce`` (Qwen3's q/k norms over one head): kept whole.

A family without a plan, or one naming any other style, is refused by name
(``tensor_parallel_problem``), as are head counts or widths that do not divide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from triollm.model.parallel.group import RankGroup
from triollm.model.parallel.layers import GatheredLogits, RowParallelOutput, VocabParallelEmbedding

__all__ = ["ShardedModel", "shard_model", "tensor_parallel_problem"]

_COLUMN = "colwise"
_ROW = "rowwise"
_VOCAB_HEAD = ("colwise_gather_output", "colwise_rep")
_VOCAB_EMBEDDING = "embedding_rowwise"
_REPLICATED = "replicated_with_grad_allreduce"
_STYLES = (_COLUMN, _ROW, *_VOCAB_HEAD, _VOCAB_EMBEDDING, _REPLICATED)
#: The config's widths that a rank's share must divide.
_DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def _causal_lm_class(hf_config: Any) -> type | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        found: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        return None
    return found[0] if isinstance(found, tuple) else found


def _class_plan(hf_config: Any) -> dict[str, str]:
    """The plan a model of ``hf_config``'s family holds once loaded (prefixed names)."""
    base = getattr(hf_config, "base_model_tp_plan", None) or {}
    model_class = _causal_lm_class(hf_config)
    prefix = getattr(model_class, "base_model_prefix", "model")
    plan = {f"{prefix}.{name}": style for name, style in base.items()}
    plan.update(getattr(model_class, "_tp_plan", None) or {})
    return plan if base else {}


def tensor_parallel_problem(hf_config: Any, size: int, *, runner: str, enable_lora: bool,
                            quantization: str | None, backend: str) -> str | None:
    """Why ``hf_config``'s model cannot run on ``size`` tensor-parallel ranks (None: it
    can)."""
    family = getattr(hf_config, "model_type", type(hf_config).__name__)
    if runner != "generate":
        return (f"{size}: pooling models run on one rank (tensor parallelism shards "
                f"generation models)")
    if enable_lora:
        return f"{size}: LoRA adapters (enable_lora) are not sharded; run them on one rank"
    if getattr(hf_config, "quantization_config", None) is not None:
        return (f"{size}: a quantized checkpoint's layers are not sharded; load the float "
                f"weights (on-the-fly --quantization int8/int4 shards)")
    if backend == "uni":
        return f"{size}: distributed_executor_backend 'uni' runs one rank"
    plan = _class_plan(hf_config)
    if not plan:
        return (f"{size}: the {family!r} family has no tensor-parallel plan in transformers "
                f"(base_model_tp_plan), so triollm cannot shard it")
    unknown = sorted({style for style in plan.values() if style not in _STYLES})
    if unknown:
        return (f"{size}: the {family!r} family's tensor-parallel plan uses "
                f"{', '.join(unknown)}, which triollm does not shard")
    for name in _DIVIDED:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value % size:
            return f"{size} does not divide the model's {name} ({value})"
    return None


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def _style_of(plan: dict[str, str], name: str) -> str | None:
    return next((style for pattern, style in plan.items() if _matches(pattern, name)), None)


def _share(rows: int, group: RankGroup) -> tuple[int, int]:
    """This rank's ``[start, end)`` of ``rows`` split in equal shares (the last short)."""
    per_rank = -(-rows // group.world_size)
    start = min(group.rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def _padded_rows(weight: torch.Tensor, group: RankGroup) -> tuple[torch.Tensor, int, int]:
    """This rank's share of ``weight``'s rows, zero-padded to an equal share."""
    start, end = _share(weight.shape[0], group)
    per_rank = -(-weight.shape[0] // group.world_size)
    shard = torch.zeros((per_rank, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    shard[:end - start] = weight[start:end]
    return shard, start, end - start


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous(), requires_grad=False)


@dataclass
class ShardedModel:
    """What ``shard_model`` did, to finish with ``install`` once the layers are final."""

    group: RankGroup
    #: Row-parallel layers by name, with the bias added after the sum.
    rows: dict[str, torch.Tensor | None] = field(default_factory=dict)
    #: The LM head's name and the vocabulary's size, where the head is split.
    head: tuple[str, int] | None = None

    def install(self, model: nn.Module) -> None:
        """Put the collectives on the modules now at the sharded layers' names."""
        modules = dict(model.named_modules())
        for name, bias in self.rows.items():
            modules[name].register_forward_hook(RowParallelOutput(self.group, bias))
        if self.head is not None:
            name, vocab_size = self.head
            modules[name].register_forward_hook(GatheredLogits(self.group, vocab_size))


@torch.no_grad()
def shard_model(model: Any, group: RankGroup) -> ShardedModel:
    """Slice ``model``'s weights in place to this rank's share by its ``_tp_plan``."""
    plan: dict[str, str] = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        plan = _class_plan(model.config)
    sharded = ShardedModel(group)
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    embedding_split = False
    for name, module in modules.items():
        style = _style_of(plan, name)
        if style is None or style == _REPLICATED:
            continue
        if style == _VOCAB_EMBEDDING and type(module) is nn.Embedding:
            weight, start, rows = _padded_rows(module.weight, group)
            replacement = VocabParallelEmbedding(_parameter(weight), start, rows, group)
            parent, _, child = name.rpartition(".")
            setattr(modules[parent] if parent else model, child, replacement)
            embedding_split = True
            if tied:
                head.weight = replacement.weight
        elif style in _VOCAB_HEAD and isinstance(module, nn.Linear):
            if not (tied and embedding_split):
                module.weight = _parameter(_padded_rows(module.weight, group)[0])
            module.out_features = module.weight.shape[0]
            sharded.head = (name, int(model.config.get_text_config().vocab_size))
        elif style == _COLUMN and isinstance(module, nn.Linear):
            start, end = _share(module.out_features, group)
            module.weight = _parameter(module.weight[start:end])
            if module.bias is not None:
                module.bias = _parameter(module.bias[start:end])
            module.out_features = end - start
        elif style == _ROW and isinstance(module, nn.Linear):
            start, end = _share(module.in_features, group)
            module.weight = _parameter(module.weight[:, start:end])
            sharded.rows[name] = module.bias
            module.register_parameter("bias", None)
            module.in_features = end - start
        else:
            raise ValueError(f"tensor_parallel_size: {name} ({type(module).__name__}) has "
                             f"the plan's style {style!r}, which triollm does not shard")
    return sharded
