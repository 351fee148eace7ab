"""Public helpers for testing code that uses triollm, without a real model.

* ``FakeModelRunner``: a deterministic ``ModelRunner`` with no torch; the next token
  of a sequence is a pure function of its last token and position, so results do not
  depend on batching, chunking or preemption. Logprobs and prompt logprobs, where
  asked for, hold only the chosen token, with ``fake_logprob(position)``. It can
  sleep per step and raise at a chosen step to test failure handling.
* ``build_tiny_model``: a random-weight transformers model of a supported family,
  saved with a tokenizer trained offline, ready for ``LLM(model=path)``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from triollm.step import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "EXTRA_FAMILIES",
    "TINY_FAMILIES",
    "FakeModelRunner",
    "build_tiny_model",
    "fake_completion",
    "fake_logprob",
    "fake_next_token",
    "served_url",
    "tiny_config",
    "train_test_tokenizer",
]

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "opt", "gpt2")
#: Built by ``tiny_config`` too, to exercise attention features (softcap, alternating
#: sliding windows) that the required families do not use.
EXTRA_FAMILIES = ("gemma2",)


def fake_next_token(last_token: int, position: int, vocab_size: int) -> int:
    """The fake model's "prediction": deterministic, never the same token twice in a row."""
    return (last_token * 7 + position * 13 + 1) % vocab_size


def fake_completion(prompt: list[int], max_tokens: int, vocab_size: int,
                    max_model_len: int | None = None) -> list[int]:
    """The tokens ``FakeModelRunner`` generates after ``prompt`` (``ignore_eos``), up to
    ``max_tokens`` or until the sequence reaches ``max_model_len``."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        if max_model_len is not None and len(tokens) >= max_model_len:
            break
        tokens.append(fake_next_token(tokens[-1], len(tokens) - 1, vocab_size))
    return tokens[len(prompt):]


class FakeModelRunner:
    """A ``ModelRunner`` that computes nothing and predicts ``fake_next_token``.

    ``step_delay`` seconds of ``time.sleep`` per step imitate model time (it runs in the
    engine's worker thread, so sleeping there is realistic). ``fail_at_step`` raises
    ``RuntimeError`` from that step (0-based), or ``fail_when`` decides per step;
    ``fail_request_when`` fails one request's part of a step (``RunnerOutput.failed``).
    """

    def __init__(
        self,
        num_kv_blocks: int = 1024,
        vocab_size: int = 1000,
        *,
        step_delay: float = 0.0,
        fail_at_step: int | None = None,
        fail_when: Callable[[SchedulerOutput], bool] | None = None,
        fail_request_when: Callable[[ScheduledRequest], bool] | None = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.fail_when = fail_when
        self.fail_request_when = fail_request_when
        self.num_steps = 0
        self.computed: list[SchedulerOutput] = []
        self.thread_ids: set[int] = set()
        self.shut_down = False

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.thread_ids.add(threading.get_ident())
        step = self.num_steps
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if step == self.fail_at_step or (self.fail_when and self.fail_when(scheduler_output)):
            raise RuntimeError(f"fake model failure at step {step}")
        self.computed.append(scheduler_output)
        output = RunnerOutput()
        for item in scheduler_output.scheduled:
            if self.fail_request_when is not None and self.fail_request_when(item):
                output.failed[item.request_id] = "fake failure of this request"
                continue
            if item.wants_prompt_logprobs:
                prompt = item.prompt_token_ids
                last = min(item.start_position + item.num_tokens, len(prompt) - 1)
                output.prompt_logprobs[item.request_id] = [
                    _fake_logprobs(prompt[position + 1], position + 1)
                    for position in range(item.start_position, last)]
            if item.sample:
                # Drafts are verified greedily: accepted while they are the prediction.
                k = item.num_draft_tokens
                position = item.start_position + item.num_tokens - 1 - k
                tokens = [fake_next_token(item.token_ids[-1 - k], position, self.vocab_size)]
                for draft in item.token_ids[len(item.token_ids) - k:]:
                    if draft != tokens[-1]:
                        break
                    tokens.append(fake_next_token(draft, position + len(tokens),
                                                  self.vocab_size))
                output.sampled_token_ids[item.request_id] = tokens[0]
                if k:
                    output.more_token_ids[item.request_id] = tokens[1:]
                if item.sampling.logprobs is not None:
                    lps = [_fake_logprobs(t, position + 1 + j) for j, t in enumerate(tokens)]
                    output.logprobs[item.request_id] = lps[0]
                    if k:
                        output.more_logprobs[item.request_id] = lps[1:]
        return output

    def shutdown(self) -> None:
        self.shut_down = True


def fake_logprob(position: int) -> float:
    """The log-probability ``FakeModelRunner`` reports for the token at ``position``."""
    return -((position % 7) + 1) / 10


def _fake_logprobs(token: int, position: int) -> TokenLogprobs:
    return TokenLogprobs(token_ids=[token], logprobs=[fake_logprob(position)], ranks=[1])


def train_test_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained offline on the bundled corpus."""
    from triollm.model.loader import demo_corpus, train_byte_level_bpe

    return train_byte_level_bpe(demo_corpus(), vocab_size=vocab_size)


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """A small config of ``family`` (one of ``TINY_FAMILIES``)."""
    import transformers

    special: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    decoder: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, **special,
    }
    configs: dict[str, Callable[[], PretrainedConfig]] = {
        "llama": lambda: transformers.LlamaConfig(**decoder),
        "qwen2": lambda: transformers.Qwen2Config(**decoder),
        "qwen3": lambda: transformers.Qwen3Config(**decoder, head_dim=16),
        "mistral": lambda: transformers.MistralConfig(**decoder, sliding_window=40),
        "opt": lambda: transformers.OPTConfig(
            vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
            **special),
        "gemma2": lambda: transformers.Gemma2Config(
            **decoder, head_dim=16, sliding_window=24, attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=512,
            **special),
    }
    if family not in configs:
        raise ValueError(f"family: expected one of {TINY_FAMILIES + EXTRA_FAMILIES}, "
                         f"got {family!r}")
    config = configs[family]()
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def build_tiny_model(
    family: str,
    directory: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Save a random-weight model of ``family`` and its tokenizer under ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer if tokenizer is not None else train_test_tokenizer()
    config = tiny_config(family, len(tokenizer), **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Random init is nearly flat; sharper logits make greedy decoding meaningful.
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.data.normal_(0.0, 0.15)
    path = Path(directory)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_lora_adapter(
    base: str | Path,
    directory: str | Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    scale: float = 0.1,
    **config: Any,
) -> Path:
    """Save a random PEFT LoRA adapter for the model at ``base`` under ``directory``:
    made with PEFT's own ``get_peft_model`` and ``save_pretrained``, with every A and B
    drawn from N(0, ``scale``) (so B is not zero and the adapter changes the output).
    ``config`` goes to ``peft.LoraConfig`` (``use_rslora``, ``rank_pattern``...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules),
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, parameter in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                parameter.data.normal_(0.0, scale)
    path = Path(directory)
    peft_model.save_pretrained(str(path))
    return path


def train_wordpiece_tokenizer(vocab_size: int = 500) -> PreTrainedTokenizerBase:
    """A BERT-style WordPiece tokenizer (``[CLS] a [SEP] b [SEP]`` with segment ids for
    pairs) trained offline on the bundled corpus."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    from triollm.model.loader import demo_corpus

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False)
    tokenizer.train_from_iterator(demo_corpus(), trainer=trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                             cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                             model_max_length=256)


def _write_json(path: Path, value: Any) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2), encoding="utf-8")


def _random_weights(model: Any, seed: int) -> None:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.data.normal_(0.0, 0.1)


def build_embedding_model(kind: str, directory: str | Path, *, seed: int = 0,
                          dense_features: int | None = None, normalize: bool = True,
                          max_seq_length: int = 128, **overrides: Any) -> Path:
    """A random-weight sentence-transformers folder under ``directory``.

    ``kind`` ``"bert"``: a BERT encoder with mean pooling (sentence-transformers' current
    file format). ``"xlm-roberta"``: an XLM-R encoder with CLS pooling. ``"qwen2"``,
    ``"qwen3"``, ``"llama"``: a decoder with last-token pooling (the legacy
    ``pooling_mode_*`` format, as Qwen3-Embedding ships); ``"gemma2"`` too, with its
    sliding window and attention-logit softcapping. ``dense_features`` adds a
    ``Dense`` (tanh) module."""
    import torch
    import transformers

    path = Path(directory)
    if kind in ("bert", "xlm-roberta"):
        tokenizer = train_wordpiece_tokenizer()
        common: dict[str, Any] = {
            "vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128,
            "max_position_embeddings": 258 if kind == "xlm-roberta" else 256,
            "pad_token_id": 0}
        config: Any = (transformers.BertConfig(**common) if kind == "bert"
                       else transformers.XLMRobertaConfig(**common))
        for name, value in overrides.items():
            setattr(config, name, value)
        model: Any = transformers.AutoModel.from_config(config, dtype=torch.float32)
        pooling: dict[str, Any] = {"embedding_dimension": config.hidden_size,
                                   "pooling_mode": "mean" if kind == "bert" else "cls"}
        module_types = "sentence_transformers.sentence_transformer.modules"
    elif kind in ("qwen2", "qwen3", "llama", "gemma2"):
        tokenizer = train_test_tokenizer()
        config = tiny_config(kind, len(tokenizer), **overrides)
        model = transformers.AutoModel.from_config(config, dtype=torch.float32)
        pooling = {"word_embedding_dimension": config.hidden_size,
                   "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}
        module_types = "sentence_transformers.models"
    else:
        raise ValueError(f"kind: expected 'bert', 'xlm-roberta', 'qwen2', 'qwen3', 'llama' or "
                         f"'gemma2', got {kind!r}")
    _random_weights(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{module_types}.pooling.Pooling"
         if kind in ("bert", "xlm-roberta") else "sentence_transformers.models.Pooling"},
    ]
    _write_json(path / "1_Pooling" / "config.json", pooling)
    if dense_features is not None:
        from safetensors.torch import save_file

        modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                        "type": "sentence_transformers.models.Dense"})
        _write_json(path / "2_Dense" / "config.json", {
            "in_features": config.hidden_size, "out_features": dense_features, "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh"})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            linear = torch.nn.Linear(config.hidden_size, dense_features)
        save_file({f"linear.{k}": v.contiguous() for k, v in linear.state_dict().items()},
                  str(path / "2_Dense" / "model.safetensors"))
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)),
                        "path": f"{len(modules)}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    _write_json(path / "modules.json", modules)
    _write_json(path / "sentence_bert_config.json", {"max_seq_length": max_seq_length,
                                                      "do_lower_case": False})
    return path


def build_cross_encoder(directory: str | Path, *, seed: int = 0, num_labels: int = 1) -> Path:
    """A random-weight BERT cross-encoder (``BertForSequenceClassification``)."""
    import transformers

    tokenizer = train_wordpiece_tokenizer()
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 256,
        "num_labels": num_labels}
    config = transformers.BertConfig(**settings)
    classifier: Any = transformers.BertForSequenceClassification(config).float()
    _random_weights(classifier, seed)
    path = Path(directory)
    classifier.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def served_url(output: IO[str], lines: list[str] | None = None) -> str | None:
    """The URL a starting ``triollm serve`` logs (``triollm serving MODEL at URL``),
    read from its ``output`` up to that line (each line appended to ``lines``); None
    when the output ends first."""
    for line in output:
        if lines is not None:
            lines.append(line)
        found = re.search(r"triollm serving .* at (http://\S+)", line)
        if found:
            return found.group(1).rstrip(",")
    return None
