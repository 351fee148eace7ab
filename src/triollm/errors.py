"""The exceptions triollm raises.

```
Exception
├── ValueError
│   ├── (bad arguments, prompts and sampling parameters: the message names the field)
│   ├── UnsupportedModelError      the architecture bypasses transformers' attention interface
│   └── LoRAAdapterError           a LoRA adapter that cannot be served on this model
│       └── LoRAAdapterNotFoundError   no adapter at that path
└── RuntimeError
    └── EngineError                base of the async engine's errors
        ├── EngineDeadError        a step failed; __cause__ is the original exception
        ├── EngineClosedError      the engine shut down before the request finished
        └── RequestFailedError     this request's own part of a step failed; the engine
                                   and every other request carry on
```
"""

from __future__ import annotations

__all__ = ["EngineClosedError", "EngineDeadError", "EngineError", "LoRAAdapterError",
           "LoRAAdapterNotFoundError", "RequestFailedError", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model's architecture does not route attention through transformers'
    attention interface, so the engine cannot plug its paged attention into it."""


class LoRAAdapterError(ValueError):
    """A LoRA adapter that cannot be served on this model; the message says why (a rank
    above ``max_lora_rank``, a module the model lacks, DoRA...)."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No PEFT adapter (``adapter_config.json``) at the path given."""


class EngineError(RuntimeError):
    """Base class of the async engine's errors."""


class EngineDeadError(EngineError):
    """The engine's step loop failed. Every request in flight, and every later call,
    gets this error; ``__cause__`` holds the exception the step raised."""


class EngineClosedError(EngineError):
    """The engine shut down (its block was left or its scope cancelled) before this
    request finished, or a request was made to an engine that is not running."""


class RequestFailedError(EngineError):
    """This request's own part of a step failed (its sampling, its logprobs, its
    detokenization). The request ends with this error; the engine and every other
    request carry on. Only a failure of the batch forward kills the engine."""
