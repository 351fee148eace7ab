"""The compile process's entry (``python -m triollm.model.runners.compile_child``):
build the model's compiled decoder into the cache and exit (compile_process.py).

It reads a ``CompileJob`` pickled on its stdin, dies with the process that started it,
lowers its priority, then sets the model up as the runner does (``load_model``, the
packed linear layers, the KV cache's layout, the decode attention, the groups of linear
layers) and compiles it. The AOT artifacts take the weights as inputs (parameters
through the module, packed weights through their handles) and hold none of their
values: artifacts compiled over all-zero weights pass the serving process's check
against its real weights. The real weights are loaded all the same: a safetensors
checkpoint in the model's dtype is memory-mapped, so the child reads pages the serving
process just brought into the page cache and shares them, where zero weights were
anonymous memory of the model's size (docs/benchmarks.md, Start-up). It compiles under
the parent's cache key only (exit code 3 where its own key differs), and prints
``RESULT_PREFIX`` and its result as JSON last.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import time

from triollm.model.attention.metadata import PagedKVCache
from triollm.model.attention.paged import ATTENTION_NAME
from triollm.model.cpu.decode import load_kernel
from triollm.model.loader import load_model
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

__all__ = ["KEY_MISMATCH", "main"]

logger = logging.getLogger(__name__)

#: Exit code: the child's cache key differs from the parent's.
KEY_MISMATCH = 3


def _build(job: CompileJob) -> dict[str, object]:
    """Set the model up as the runner does (outside inference mode, as there), compile."""
    config = job.config
    model_config = config.model
    started = time.perf_counter()
    model = load_model(
        model_config.model, model_config.hf_config, attn_implementation=ATTENTION_NAME,
        dtype=model_config.dtype, device=model_config.device,
        trust_remote_code=model_config.trust_remote_code, revision=model_config.revision,
        download_dir=model_config.download_dir,
        quantization=(model_config.quantization.method
                      if model_config.quantization is not None else None))
    prepare_for_cpu(model, model_config.cpu_threads, model_config.quantization)
    specs = profile_kv_specs(model, config)
    scratch = PagedKVCache(specs, SCRATCH_BLOCKS, config.cache.block_size,
                           job.cache_dtype, model_config.device)
    scratch.number_layers(model)
    dummy = DummyDecodes(model, scratch, config, specs)
    attention = choose_decode_attention(dummy, load_kernel(), job.cache_dtype)
    plan = plan_compile(dummy, attention, job.counts)
    key = compile_key(dummy, attention, model_config.dtype)
    logger.info("set the model up in %.1f s", time.perf_counter() - started)
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
    logging.getLogger("triollm.model.loader").setLevel(logging.ERROR)  # the server said it
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
