"""The pooling model runner: embeddings, classifiers and cross-encoders.

One step is one forward over whole prompts packed into a ``[1, T]`` row, sorted by
length so prompts of equal length share one attention call (model/attention/varlen.py);
no padding between prompts and no KV cache. Where linear layers run on oneDNN (fp32, or
bf16 without AVX512-BF16), each would copy a row count outside packed_linear.py's
bounded set into a padded buffer (a noticeable share of an fp32 embedding step), so the
row is filled up to such a count once, with filler prompts of token 0 that attend only to each
other and are never pooled. The scheduler still accounts tokens in blocks, so the
runner reports enough blocks for a full step's worth of prompts and reads none of
them. The last hidden states are pooled per prompt (model/pooler.py); a classifier's
own head turns the pooled rows into label scores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from triollm.config import EngineConfig
from triollm.model.attention.varlen import VARLEN_ATTENTION_NAME, VarlenMetadata
from triollm.model.cpu.helpers import drain_pools
from triollm.model.cpu.packed_linear import padded_rows, pads_rows
from triollm.model.cpu.threads import ComputeThreads
from triollm.model.cpu.varlen import VarlenKernel, load_varlen_kernel
from triollm.model.loader import load_pooling_model
from triollm.model.pooler import Pooler
from triollm.model.runners.setup import prepare_for_cpu
from triollm.model.runners.summary import log_pooling_summary
from triollm.pooling_params import PoolingParams
from triollm.step import RunnerOutput, ScheduledRequest, SchedulerOutput

__all__ = ["PoolingModelRunner"]

logger = logging.getLogger(__name__)

#: Longest filler prompt (fewer positions than any model has).
FILLER_PROMPT = 64

#: (pooled rows in the model's dtype) -> logits
ClassifierHead = Callable[[torch.Tensor], torch.Tensor]


class PoolingModelRunner:
    """Runs a transformers encoder or decoder as an embedder or sequence classifier."""

    def __init__(self, config: EngineConfig) -> None:
        model_config = config.model
        pooler_config = model_config.pooler
        if pooler_config is None:
            raise ValueError("runner: the pooling runner needs a pooling model config")
        self.task = pooler_config.task
        self.device = model_config.device
        self.dtype = model_config.dtype
        hub = {"revision": model_config.revision, "download_dir": model_config.download_dir}
        self.model = load_pooling_model(
            model_config.model, model_config.hf_config, classify=self.task == "classify",
            attn_implementation=VARLEN_ATTENTION_NAME, dtype=self.dtype, device=self.device,
            trust_remote_code=model_config.trust_remote_code,
            quantization=(model_config.quantization.method
                          if model_config.quantization is not None else None), **hub)
        self.encoder: nn.Module = self.model.base_model if self.task == "classify" else self.model
        embeddings = getattr(self.encoder, "embeddings", None)
        positions = getattr(embeddings, "position_embeddings", None)
        padding_idx = getattr(positions, "padding_idx", None)
        #: RoBERTa-style encoders number positions from ``padding_idx + 1``.
        self.position_offset = padding_idx + 1 if padding_idx is not None else 0
        self.uses_token_types = hasattr(embeddings, "token_type_embeddings")
        self.head = self._classifier_head() if self.task == "classify" else None
        self.pooler = Pooler(pooler_config, model_config.model, self.device, **hub)
        self.compute_threads: ComputeThreads | None = (
            prepare_for_cpu(self.model, model_config.cpu_threads,
                            model_config.quantization)
            if self.device.type == "cpu" else None)
        scheduler = config.scheduler
        #: Prompt attention's C kernel on CPU, unless ``enforce_eager`` (SDPA then).
        self.varlen_kernel: VarlenKernel | None = (
            load_varlen_kernel() if self.compute_threads is not None
            and not model_config.enforce_eager else None)
        #: Whether steps are filled up to a row count oneDNN layers take without a copy.
        self.fills_rows = self.compute_threads is not None and pads_rows(self.model)
        self.num_kv_blocks = (-(-scheduler.max_num_batched_tokens // config.cache.block_size)
                              + scheduler.max_num_seqs)
        logger.info("pooling model: task %s, %s pooling%s, %d-dim output (from %s)",
                    self.task, pooler_config.pooling_type,
                    f", {len(pooler_config.dense_layers)} Dense" if pooler_config.dense_layers
                    else "", pooler_config.embedding_size, pooler_config.source)
        self._check_attention()
        log_pooling_summary(config, self.model, self.task, self.compute_threads,
                            "C kernel" if self.varlen_kernel is not None else "SDPA")

    def _classifier_head(self) -> ClassifierHead:
        model = self.model
        score = getattr(model, "score", None)
        if isinstance(score, nn.Module):  # decoder families: a linear on the pooled row
            return score
        classifier = getattr(model, "classifier", None)
        encoder_pooler = getattr(self.encoder, "pooler", None)
        if isinstance(classifier, nn.Linear) and isinstance(encoder_pooler, nn.Module):
            dropout = getattr(model, "dropout", nn.Identity())
            # BERT: its pooler (dense + tanh over the first token), then the classifier
            return lambda rows: classifier(dropout(encoder_pooler(rows[:, None, :])))
        if isinstance(classifier, nn.Module) and not isinstance(classifier, nn.Linear):
            # RoBERTa / XLM-R: a head module that reads the first token itself
            return lambda rows: classifier(rows[:, None, :])
        raise ValueError(f"convert: {type(model).__name__}'s classification head is not "
                         f"supported (supported: BERT, RoBERTa/XLM-R and decoder families)")

    @torch.inference_mode()
    def _check_attention(self) -> None:
        """One forward of two short prompts: our attention must be the one called."""
        metadata = VarlenMetadata.from_lengths([3, 2], self.varlen_kernel)
        offset = self.position_offset
        self._hidden([5, 6, 7, 8, 9], [offset + p for p in (0, 1, 2, 0, 1)], None, metadata)
        if not metadata.num_calls:
            raise RuntimeError("the model never called its attention interface")

    # -- the step ------------------------------------------------------------------

    def _hidden(self, input_ids: list[int], positions: list[int],
                token_types: list[int] | None, metadata: VarlenMetadata) -> torch.Tensor:
        device = self.device
        # encoders and decoders both take use_cache; decoders would build a KV cache
        kwargs: dict[str, object] = {"use_cache": False}
        if self.uses_token_types:
            types = token_types if token_types is not None else [0] * len(input_ids)
            kwargs["token_type_ids"] = torch.tensor(types, dtype=torch.long, device=device)[None]
        output = self.encoder(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device)[None],
            position_ids=torch.tensor(positions, dtype=torch.long, device=device)[None],
            triollm_metadata=metadata, **kwargs)
        return output.last_hidden_state[0]

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        started = time.perf_counter()
        if scheduler_output.is_empty:
            return RunnerOutput()
        if self.compute_threads is not None:
            self.compute_threads.adjust()
        failed: dict[str, str] = {}
        items: list[ScheduledRequest] = []
        for item in scheduler_output.scheduled:
            if item.pooling_params is None:
                failed[item.request_id] = "a pooling model serves pooling requests only"
            elif item.start_position != 0 or item.num_tokens != len(item.prompt_token_ids):
                failed[item.request_id] = "a pooling request must run its whole prompt at once"
            else:
                items.append(item)
        if not items:
            return RunnerOutput(failed=failed)
        items.sort(key=lambda item: item.num_tokens)
        input_ids: list[int] = []
        positions: list[int] = []
        token_types: list[int] | None = [] if self.uses_token_types else None
        offset = self.position_offset
        for item in items:
            input_ids.extend(item.token_ids)
            positions.extend(range(offset, offset + item.num_tokens))
            if token_types is not None:
                assert item.pooling_params is not None
                types = item.pooling_params.token_type_ids
                token_types.extend(types if types is not None else [0] * item.num_tokens)
        lengths = [item.num_tokens for item in items]
        real_tokens = len(input_ids)
        if self.fills_rows:
            filler = padded_rows(real_tokens) - real_tokens
            while filler > 0:
                length = min(filler, FILLER_PROMPT)
                input_ids.extend([0] * length)
                positions.extend(range(offset, offset + length))
                if token_types is not None:
                    token_types.extend([0] * length)
                lengths.append(length)
                filler -= length
        metadata = VarlenMetadata.from_lengths(lengths, self.varlen_kernel)
        forward_started = time.perf_counter()
        hidden = self._hidden(input_ids, positions, token_types, metadata)[:real_tokens]
        forward_seconds = time.perf_counter() - forward_started
        pooled = self.pooler.pool(hidden, metadata.spans[:len(items)])
        finish: Callable[[torch.Tensor, PoolingParams], torch.Tensor]
        if self.head is not None:
            vectors = self.head(pooled.to(self.dtype)).float()
            finish = Pooler.finish_scores
        else:
            vectors = self.pooler.project(pooled)
            finish = Pooler.finish_embedding
        vectors = vectors.cpu()
        pooled_by_id = {}
        for row, item in enumerate(items):
            assert item.pooling_params is not None
            pooled_by_id[item.request_id] = finish(vectors[row], item.pooling_params).clone()
        return RunnerOutput(failed=failed, pooled=pooled_by_id, forward_seconds=forward_seconds,
                            execute_seconds=time.perf_counter() - started)

    def shutdown(self) -> None:
        drain_pools()  # no kernel helper reads the weights or the cache once they go
        del self.model
        del self.encoder
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
