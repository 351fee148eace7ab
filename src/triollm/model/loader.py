"""Model configs, weights and tokenizers: from a local directory or hub id through
transformers' ``from_pretrained``, or the built-in demo model built in-process."""

from __future__ import annotations

import functools
import logging
import threading
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from triollm.config import DEMO_MODEL_NAME
from triollm.errors import UnsupportedModelError
from triollm.model.quantization.checkpoint_files import checkpoint_directory
from triollm.model.quantization.checkpoint_format import CheckpointFormat
from triollm.model.quantization.checkpoint_loader import load_quantized_model
from triollm.model.quantization.detect import checkpoint_format

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "DEMO_MODEL_NAME",
    "SUPPORTED_FAMILIES",
    "build_demo_tokenizer",
    "check_supported",
    "load_generation_config",
    "load_hf_config",
    "load_model",
    "load_pooling_model",
    "load_tokenizer",
    "train_byte_level_bpe",
]

logger = logging.getLogger(__name__)

#: transformers' model loading swaps torch.nn.init's functions for the whole process and
#: puts them back on the way out, so two loads that overlap in threads (two engines
#: starting in one process) leave the swapped ones in place, and every later load skips
#: tying weights (a tied head left on the meta device). One load at a time.
_LOADING = threading.Lock()

SUPPORTED_FAMILIES = ("Llama", "Qwen2", "Qwen3", "Mistral", "OPT", "GPT-2")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def _hub(revision: str | None, download_dir: str | None) -> dict[str, Any]:
    """``from_pretrained``'s keywords for a revision and a download directory."""
    kwargs: dict[str, Any] = {}
    if revision is not None:
        kwargs["revision"] = revision
    if download_dir is not None:
        kwargs["cache_dir"] = download_dir
    return kwargs


def load_hf_config(model: str, *, trust_remote_code: bool = False,
                   revision: str | None = None, download_dir: str | None = None
                   ) -> PretrainedConfig:
    if model == DEMO_MODEL_NAME:
        return demo_config()
    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code,
                                      **_hub(revision, download_dir))


def load_generation_config(source: str, *, revision: str | None = None,
                           download_dir: str | None = None) -> dict[str, Any]:
    """The non-default fields of ``source``'s ``generation_config.json`` (a model
    directory or hub id); empty when it has none."""
    if source == DEMO_MODEL_NAME:
        return {}
    try:
        config = transformers.GenerationConfig.from_pretrained(
            source, **_hub(revision, download_dir))
    except OSError:
        return {}
    return dict(config.to_diff_dict())


def demo_config() -> PretrainedConfig:
    return transformers.LlamaConfig(
        vocab_size=len(build_demo_tokenizer()),
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=True,
    )


def check_supported(model_class: type) -> None:
    """Raise ``UnsupportedModelError`` unless the class uses the attention interface."""
    if not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{model_class.__name__} does not use transformers' attention interface, so "
            f"triollm cannot plug its paged attention into it. Supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)} (and other architectures whose attention "
            f"goes through transformers' AttentionInterface)."
        )


def load_model(
    model: str,
    hf_config: PretrainedConfig,
    *,
    attn_implementation: str,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    quantization: str | None = None,
) -> PreTrainedModel:
    """Load the model with our attention plugged in, in eval mode, on ``device``; a
    quantized checkpoint (or ``quantization``, vLLM's ``--quantization``, naming its
    format) loads through ``model/quantization``."""
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "dtype": dtype}
    model_class = _causal_lm_class(hf_config)
    if model_class is not None:
        check_supported(model_class)
    if model == DEMO_MODEL_NAME:
        logger.warning("%s is a built-in demo with random weights: it writes noise. Pass "
                       "--model / model= to serve a real model.", DEMO_MODEL_NAME)
    return _instantiate(AutoModelForCausalLM, model, hf_config, kwargs, device,
                        trust_remote_code, revision, download_dir, quantization)


def _instantiate(auto: Any, model: str, hf_config: PretrainedConfig, kwargs: dict[str, Any],
                 device: torch.device, trust_remote_code: bool, revision: str | None,
                 download_dir: str | None, quantization: str | None = None) -> PreTrainedModel:
    """``auto.from_pretrained`` (the demo model: seeded random weights), checked, in eval
    mode on ``device``."""
    logger.info("loading the model %s...", model)
    started = time.perf_counter()
    with _LOADING:
        loaded = _load(auto, model, hf_config, kwargs, trust_remote_code, revision,
                       download_dir, quantization)
    check_supported(type(loaded))
    loaded = loaded.to(device).eval()
    size = sum(p.numel() * p.element_size() for p in loaded.parameters())
    logger.info("loaded the model in %.1f s (%.2f GiB of weights)",
                time.perf_counter() - started, size / 2**30)
    return loaded


def _load(auto: Any, model: str, hf_config: PretrainedConfig, kwargs: dict[str, Any],
          trust_remote_code: bool, revision: str | None, download_dir: str | None,
          quantization: str | None) -> Any:
    if model == DEMO_MODEL_NAME:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            loaded = auto.from_config(hf_config, **kwargs)
    elif (quantized := _checkpoint_format(model, hf_config, quantization, revision,
                                          download_dir)) is not None:
        loaded = load_quantized_model(auto, model, hf_config, quantized, kwargs,
                                      trust_remote_code=trust_remote_code,
                                      revision=revision, download_dir=download_dir)
    else:
        loaded = auto.from_pretrained(model, config=hf_config,
                                      trust_remote_code=trust_remote_code,
                                      **_hub(revision, download_dir), **kwargs)
    return loaded


def _checkpoint_format(model: str, hf_config: PretrainedConfig, quantization: str | None,
                       revision: str | None, download_dir: str | None
                       ) -> CheckpointFormat | None:
    """The quantized checkpoint's format (model/quantization/detect.py); None: load in
    ``dtype`` through ``from_pretrained``."""
    files = functools.partial(checkpoint_directory, model, revision=revision,
                              download_dir=download_dir)
    return checkpoint_format(hf_config, quantization, files)


def load_pooling_model(
    model: str,
    hf_config: PretrainedConfig,
    *,
    classify: bool,
    attn_implementation: str,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    quantization: str | None = None,
) -> PreTrainedModel:
    """A pooling model in eval mode on ``device``: the bare transformer (``AutoModel``:
    a causal LM's checkpoint loads without its head) or, with ``classify``, the
    ``AutoModelForSequenceClassification`` model with its head."""
    auto: Any = (transformers.AutoModelForSequenceClassification if classify
                 else transformers.AutoModel)
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "dtype": dtype}
    return _instantiate(auto, model, hf_config, kwargs, device, trust_remote_code, revision,
                        download_dir, quantization)


def _causal_lm_class(hf_config: PretrainedConfig) -> type | None:
    try:
        found: Any = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        return None  # remote code: checked after loading
    if isinstance(found, tuple):
        found = next((cls for cls in found if cls is not None), None)
    return found if isinstance(found, type) else None


def load_tokenizer(name: str, *, trust_remote_code: bool = False,
                   revision: str | None = None, download_dir: str | None = None
                   ) -> PreTrainedTokenizerBase:
    if name == DEMO_MODEL_NAME:
        return build_demo_tokenizer()
    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code,
                                         **_hub(revision, download_dir))


def train_byte_level_bpe(texts: list[str], vocab_size: int) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE tokenizer offline with the ``tokenizers`` library.

    Any text can be encoded (byte fallback through the byte-level alphabet); it has
    ``<s>`` / ``</s>`` / ``<pad>`` and a chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def demo_corpus() -> list[str]:
    text = resources.files("triollm.model").joinpath("demo_corpus.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


@functools.lru_cache(maxsize=1)
def _demo_tokenizer() -> PreTrainedTokenizerBase:
    return train_byte_level_bpe(demo_corpus(), vocab_size=DEMO_VOCAB_TARGET)


def build_demo_tokenizer() -> PreTrainedTokenizerBase:
    """The demo model's tokenizer, trained once per process on the bundled corpus."""
    return _demo_tokenizer()


DEMO_VOCAB_TARGET = 1024
