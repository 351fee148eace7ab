"""Where a model comes from, checked before anything loads: a local directory or a
Hugging Face hub id, as transformers' ``from_pretrained`` reads the name.

An existing directory is local. A name that looks like a path (it starts with ``/``,
``./``, ``../`` or ``~``, has more than one ``/``, or is no valid hub id) but is no
directory does not exist. Anything else (``gpt2``, ``org/name``) is a hub id: while
offline (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``) it must be in the Hugging Face
cache; online, ``probe_hub`` asks the hub once whether it is there. Nothing here imports
torch or transformers, so a mistake is reported in a fraction of a second.
"""

from __future__ import annotations

import os

from triollm.config import DEMO_MODEL_NAME

__all__ = ["hub_offline_variable", "model_source_problem"]

_LOCAL_PREFIXES = ("/", "./", "../", "~")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline_variable() -> str | None:
    """The environment variable that puts the hub offline (huggingface_hub's reading),
    or None when it is online."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().upper() in _TRUE:
            return name
    return None


def model_source_problem(name: str, *, revision: str | None = None,
                         download_dir: str | None = None, probe_hub: bool = False,
                         tokenizer: bool = False) -> str | None:
    """What is wrong with ``name`` as a model (or, with ``tokenizer``, a tokenizer)
    source, as a phrase to follow the flag's name (``"path ./x does not exist"``); None
    when it can load or only loading can tell."""
    if name == DEMO_MODEL_NAME:
        return None
    if os.path.isdir(name):
        if tokenizer or os.path.isfile(os.path.join(name, "config.json")):
            return None
        return f"directory {name} has no config.json (not a transformers model)"
    if _looks_local(name) or not _is_hub_id(name):
        if os.path.exists(name):
            return f"path {name} is a file, not a model directory"
        expanded = os.path.expanduser(name)
        hint = (f" (~ is not expanded here; write {expanded})"
                if expanded != name and os.path.isdir(expanded) else "")
        return f"path {name} does not exist{hint}"
    if _in_hub_cache(name, revision, download_dir):
        return None
    offline = hub_offline_variable()
    if offline is not None:
        return (f"{name} is not a local directory, and not in the Hugging Face cache "
                f"while {offline} is set (nothing is downloaded)")
    return _ask_hub(name, revision) if probe_hub else None


def _looks_local(name: str) -> bool:
    return (name.startswith(_LOCAL_PREFIXES) or name in (".", "..") or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _in_hub_cache(name: str, revision: str | None, download_dir: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json", cache_dir=download_dir,
                                   revision=revision)
    return isinstance(found, str)


#: (name, revision) the hub already said it has: a second check (the CLI's, then the
#: engine arguments') asks it once.
_on_the_hub: set[tuple[str, str | None]] = set()


def _ask_hub(name: str, revision: str | None) -> str | None:
    if (name, revision) in _on_the_hub:
        return None
    problem = _ask_hub_once(name, revision)
    if problem is None:
        _on_the_hub.add((name, revision))
    return problem


def _ask_hub_once(name: str, revision: str | None) -> str | None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        HfApi().model_info(name, revision=revision, timeout=10)
    except GatedRepoError:
        return None  # loading says what access it needs
    except RepositoryNotFoundError:
        return f"{name} is neither a local directory nor a model on the Hugging Face hub"
    except RevisionNotFoundError:
        return f"{name} has no revision {revision!r} on the Hugging Face hub"
    except HfHubHTTPError:
        return None  # the hub answered; loading reports what it says
    except Exception as error:  # the hub cannot be reached (connection, DNS, timeout)
        return (f"{name} is not a local directory nor in the Hugging Face cache, and the "
                f"hub cannot be reached ({type(error).__name__}: {error}); set "
                f"HF_HUB_OFFLINE=1 to load only from the cache")
    return None
