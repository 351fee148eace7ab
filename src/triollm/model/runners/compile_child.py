"""The compile process's entry (``python -m triollm.model.runners.compile_child``):
build the model's compiled decoder into the cache and exit (compile_process.py).

It reads a ``CompileJob`` pickled on its stdin, dies with the process that started it,
lowers its priority, then sets the model up as the runner does (the same structure,
packed linear layers, KV-cache layout and decode attention), but with every weight
zero: the AOT artifacts take the weights as inputs (parameters through the module,
packed weights through their handles) and hold none of their values, so the real
weights would only cost the load's time and a second copy of the model in memory. The
parent checks the compiled forward against its own eager logits when it loads it.
It compiles under the parent's cache key only (exit code 3 where its own key differs),
and prints ``RESULT_PREFIX`` and its result as JSON last.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from triollm.config import ModelConfig
from triollm.model.attention.metadata import PagedKVCache
from triollm.model.attention.paged import ATTENTION_NAME
from triollm.model.cpu.decode import load_kernel
from triollm.model.runners.compile import (
    SCRATCH_BLOCKS,
    DummyDecodes,
    build_compiled,
    choose_decode_attention,
    compile_key,
    plan_compile,
)
from triollm.model.runners.compile_process import (
    NICENESS,
    RESULT_PREFIX,
    CompileJob,
    die_with_parent,
)
from triollm.model.runners.setup import prepare_for_cpu, profile_kv_specs

__all__ = ["KEY_MISMATCH", "main", "model_with_zero_weights"]

logger = logging.getLogger(__name__)

#: Exit code: the child's cache key differs from the parent's.
KEY_MISMATCH = 3


def model_with_zero_weights(config: ModelConfig) -> PreTrainedModel:
    """The model of ``config`` (its class, config, dtype, tied embeddings), without
    reading its weights: all of them zero."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(
            config.hf_config, attn_implementation=ATTENTION_NAME, dtype=config.dtype,
            trust_remote_code=config.trust_remote_code)
    model.tie_weights()
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.zero_()
    return model.to(config.device).eval()


def _build(job: CompileJob) -> dict[str, object]:
    """Set the model up as the runner does (outside inference mode, as there), compile."""
    config = job.config
    model_config = config.model
    started = time.perf_counter()
    model = model_with_zero_weights(model_config)
    prepare_for_cpu(model, model_config.cpu_threads, model_config.quantization)
    specs = profile_kv_specs(model, config)
    scratch = PagedKVCache(specs, SCRATCH_BLOCKS, config.cache.block_size,
                           job.cache_dtype, model_config.device)
    scratch.number_layers(model)
    dummy = DummyDecodes(model, scratch, config, specs)
    attention = choose_decode_attention(dummy, load_kernel(), job.cache_dtype)
    plan = plan_compile(dummy, attention, job.counts)
    key = compile_key(dummy, attention, model_config.dtype)
    logger.info("set the model up (zero weights) in %.1f s", time.perf_counter() - started)
    if key != job.key:
        return {"key": key, "compiled": False}
    return {"key": key, "compiled": build_compiled(dummy, attention, plan, model_config.dtype)}


def main() -> int:
    job: CompileJob = pickle.load(sys.stdin.buffer)
    die_with_parent(job.parent_pid)
    os.setpriority(os.PRIO_PROCESS, 0, NICENESS)  # absolute: its thread's is inherited
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="%(levelname)s\t%(name)s\t%(message)s")
    for name in ("triollm.model.runners.compile", __name__):  # its progress, no more
        logging.getLogger(name).setLevel(logging.INFO)
    result = _build(job)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if result["key"] != job.key:
        return KEY_MISMATCH
    return 0 if result["compiled"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown (seconds with torch): nothing is left to save
