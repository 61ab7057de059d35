"""Sharing Focus adapters on the Hugging Face Hub: resolve, push, model cards, `push`/`pull` CLI commands.

Everything goes through the real `huggingface_hub` client, so the cache layout, revisions, tokens,
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` behave exactly as for any other Hub download. This module only adds
what a Focus adapter needs on top: both files must come from the same commit, and every failure is turned
into an error that says what is wrong and what to do about it.

``huggingface_hub`` reads ``HF_ENDPOINT``/``HF_HUB_OFFLINE``/``HF_HUB_CACHE`` once, at import time, into
``huggingface_hub.constants``; the functions here read those constants at call time (no module-level
``HfApi`` instance), so changing the constants (as the tests do) takes effect immediately.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import struct
import sys
import warnings
from importlib import resources
from typing import Any

from focus_flex.config import CONFIG_NAME, WEIGHTS_NAME, FocusConfig, __version__

__all__ = [
    "HubError", "AdapterRepoNotFoundError", "AdapterRevisionNotFoundError", "AdapterFileNotFoundError",
    "AdapterNotCachedError", "IncompleteAdapterError", "HubAuthError", "BaseModelMismatchWarning",
    "resolve_adapter_dir", "push_folder_to_hub", "model_card", "check_base_model", "validate_adapter_folder",
    "add_hub_commands",
]

REQUIRED_FILES = (CONFIG_NAME, WEIGHTS_NAME)
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
_LOGIN_HINT = "pass token=... (CLI: --token), set HF_TOKEN, or run `hf auth login`"


# ---- errors ---------------------------------------------------------------------------------------
class HubError(OSError):
    """Base class of the Hub errors raised by focus_flex (an OSError, like huggingface_hub's own)."""


class AdapterRepoNotFoundError(HubError):
    """The repo does not exist, or it is private/gated and the request was not authorised to see it."""


class AdapterRevisionNotFoundError(HubError):
    """The repo exists but the requested branch/tag/commit does not."""


class AdapterFileNotFoundError(HubError):
    """The repo/revision exists but lacks a file a Focus adapter needs (wrong repo, subfolder or revision)."""


class AdapterNotCachedError(HubError):
    """Offline (HF_HUB_OFFLINE=1, local_files_only=True, no connection) and the adapter is not cached."""


class IncompleteAdapterError(HubError):
    """A cached snapshot holds only part of the adapter (an interrupted or partial download)."""


class HubAuthError(HubError):
    """Missing, invalid or insufficient token."""


class BaseModelMismatchWarning(UserWarning):
    """The adapter was trained for another base model than the one it is attached to."""


# ---- resolving ------------------------------------------------------------------------------------
def _hf():
    import huggingface_hub
    import huggingface_hub.constants  # noqa: F401  (submodules: not lazy attributes of the package)
    import huggingface_hub.errors  # noqa: F401
    import huggingface_hub.utils  # noqa: F401

    return huggingface_hub


def _cache_dir(cache_dir: str | os.PathLike | None) -> str:
    return os.fspath(cache_dir) if cache_dir is not None else _hf().constants.HF_HUB_CACHE


def _describe(repo_id: str, revision: str | None, subfolder: str | None) -> str:
    out = f"{repo_id!r}"
    if subfolder:
        out += f" (subfolder {subfolder!r})"
    return out + f" at revision {revision or 'main'!r}"


def _token_was_sent(token: bool | str | None) -> bool:
    if token is False:
        return False
    if isinstance(token, str):
        return True
    return _hf().get_token() is not None


def _check_local_adapter_dir(path: str, files: tuple[str, ...] = REQUIRED_FILES) -> str:
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        hint = ""
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            hint = " It holds adapter_config.json: that is a PEFT adapter, not a Focus adapter."
        raise FileNotFoundError(
            f"{path!r} is a directory but not a Focus adapter folder: it lacks {', '.join(missing)} "
            f"(a Focus adapter folder holds {CONFIG_NAME} and {WEIGHTS_NAME}, as written by "
            f"`FocusAdapter.save_pretrained`).{hint}")
    return os.path.abspath(path)


def _repo_files_hint(repo_id: str, revision: str | None, token) -> str:
    """Best effort: what the repo does contain, to make 'file not found' actionable."""
    try:
        files = _hf().HfApi().list_repo_files(repo_id, revision=revision, token=token)
    except Exception:  # a hint must never hide the real error
        return ""
    adapters = sorted({os.path.dirname(f) for f in files if os.path.basename(f) == CONFIG_NAME})
    if adapters:
        where = ", ".join(repr(d) if d else "the repo root" for d in adapters)
        return f" The repo has Focus adapter configs in: {where} (pass subfolder=... accordingly)."
    if any(os.path.basename(f) == "adapter_config.json" for f in files):
        return " The repo holds adapter_config.json: it is a PEFT adapter, not a Focus adapter."
    shown = ", ".join(files[:12]) + (" ..." if len(files) > 12 else "")
    return f" Files in the repo: {shown or '(none)'}."


def _translate(err: Exception, *, repo_id: str, revision: str | None, subfolder: str | None, filename: str,
               token, cache_dir: str, local_files_only: bool, have: str | None) -> Exception | None:
    """Map a huggingface_hub error to a focus_flex one (None: not ours to translate)."""
    hf = _hf()
    errors = hf.errors
    what = _describe(repo_id, revision, subfolder)
    endpoint = hf.constants.ENDPOINT
    if isinstance(err, errors.GatedRepoError):
        return HubAuthError(
            f"Adapter repo {repo_id!r} is gated: accept its access conditions on {endpoint}/{repo_id} "
            f"with your account, then {_LOGIN_HINT}.")
    if isinstance(err, errors.RepositoryNotFoundError):
        if not _token_was_sent(token):
            return AdapterRepoNotFoundError(
                f"Adapter repo {repo_id!r} was not found on {endpoint}, or it is private and no token "
                f"was sent. Check the repo id; if the repo is private, {_LOGIN_HINT}. (A local folder "
                f"must exist: {repo_id!r} is not a directory here.)")
        return AdapterRepoNotFoundError(
            f"Adapter repo {repo_id!r} was not found on {endpoint} (a token was sent). Check the repo id, "
            "and if the repo is private, that the token belongs to an account with read access to it.")
    if isinstance(err, errors.RevisionNotFoundError):
        refs = ""
        try:
            r = hf.HfApi().list_repo_refs(repo_id, token=token)
            refs = f" Branches: {', '.join(b.name for b in r.branches)}" + (
                f"; tags: {', '.join(t.name for t in r.tags)}." if r.tags else ".")
        except Exception:
            pass
        return AdapterRevisionNotFoundError(
            f"Revision {revision!r} not found in adapter repo {repo_id!r}: pass an existing branch, tag or "
            f"full 40-character commit sha as revision=.{refs} (The adapter's revision is independent of "
            "the base model's, which is recorded in the config as base_model_revision.)")
    if isinstance(err, errors.RemoteEntryNotFoundError):
        return AdapterFileNotFoundError(
            f"{what} has no {filename!r}: it is not a Focus adapter, or the adapter sits in a subfolder "
            f"or on another revision. A Focus adapter needs both {CONFIG_NAME} and {WEIGHTS_NAME}."
            + _repo_files_hint(repo_id, revision, token))
    if isinstance(err, errors.LocalEntryNotFoundError):
        offline = hf.constants.HF_HUB_OFFLINE
        partial = have or _cached_partial(repo_id, revision, subfolder, cache_dir)
        if partial is not None:
            present = [f for f in REQUIRED_FILES if os.path.isfile(os.path.join(partial, f))]
            missing = [f for f in REQUIRED_FILES if f not in present]
            return IncompleteAdapterError(
                f"Both files are needed; the cached snapshot at {partial!r} has {', '.join(present)} but "
                f"lacks {', '.join(missing)} (partial download), and the Hub cannot be asked for it "
                f"({_why_offline(offline, local_files_only)}). Delete {partial!r} and retry online, e.g. "
                f"{_pull_cmd(repo_id, revision, subfolder)}.")
        return AdapterNotCachedError(
            f"Cannot load adapter {what}: it is not in the cache ({cache_dir}) and the Hub cannot be reached "
            f"({_why_offline(offline, local_files_only)}). "
            + ("Set HF_HUB_OFFLINE=0 (and local_files_only=False) with network access, or download it first "
               f"with {_pull_cmd(repo_id, revision, subfolder)} on a connected machine and copy the cache."
               if offline or local_files_only else
               f"Check the connection to {endpoint} (HF_ENDPOINT), or download it first with "
               f"{_pull_cmd(repo_id, revision, subfolder)}."))
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, errors.HfHubHTTPError) and status == 401:
        return HubAuthError(f"The Hub rejected the token while fetching {what} (401 Unauthorized): the "
                            f"token is invalid or expired; {_LOGIN_HINT} with a valid one.")
    if isinstance(err, errors.HFValidationError):
        return AdapterRepoNotFoundError(
            f"{repo_id!r} is neither an existing local directory nor a valid Hub repo id "
            f"('namespace/name'): check the path.")
    return None


def _cached_partial(repo_id: str, revision: str | None, subfolder: str | None, cache_dir: str) -> str | None:
    """The cached snapshot folder holding some (not all) adapter files for this revision, if any."""
    for f in REQUIRED_FILES:
        name = f"{subfolder.strip('/')}/{f}" if subfolder else f
        try:
            p = _hf().try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=revision)
        except Exception:
            continue
        if isinstance(p, str):
            return os.path.dirname(p)
    return None


def _pull_cmd(repo_id: str, revision: str | None, subfolder: str | None) -> str:
    cmd = f"focus-flex pull {repo_id}"
    if revision:
        cmd += f" --revision {revision}"
    if subfolder:
        cmd += f" --subfolder {subfolder}"
    return f"`{cmd}`"


def _why_offline(offline: bool, local_files_only: bool) -> str:
    if offline:
        return "HF_HUB_OFFLINE is set"
    if local_files_only:
        return "local_files_only=True"
    return "no connection"


def resolve_adapter_dir(name_or_path: str | os.PathLike, *, revision: str | None = None,
                        subfolder: str | None = None, token: bool | str | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                        files: tuple[str, ...] = REQUIRED_FILES) -> str:
    """A local directory holding ``focus_config.json`` and ``focus_adapter.safetensors`` (or only ``files``).

    ``name_or_path`` is an existing local directory (checked first: a local directory is never taken for a
    repo id; ``subfolder`` applies to it too) or a Hub model repo id. Files are fetched with
    ``hf_hub_download`` into the normal Hugging Face cache, so revisions (branch, tag, commit sha), tokens,
    ``HF_HUB_OFFLINE`` and ``local_files_only`` mean what they mean everywhere else. The weights are fetched
    at the exact commit the config came from, so the two files can never come from two different pushes. The
    returned directory is the snapshot folder (plus ``subfolder``) inside the cache: treat it as read-only.
    ``files=(CONFIG_NAME,)`` resolves the config alone (what `FocusConfig.from_pretrained` needs).

    Raises the `HubError` subclasses of this module (all OSErrors) with a message saying what to do.
    """
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {path!r} is a local folder, which has "
                             "no revisions: drop revision, or pass the repo id.")
        folder = os.path.join(path, subfolder) if subfolder else path
        if not os.path.isdir(folder):
            raise AdapterRepoNotFoundError(f"{folder!r} does not exist: the local folder {path!r} has no "
                                           f"subfolder {subfolder!r}.")
        return _check_local_adapter_dir(folder, files)
    if os.path.isfile(path):
        raise AdapterRepoNotFoundError(f"{path!r} is a file; pass the folder that holds {CONFIG_NAME} and "
                                       f"{WEIGHTS_NAME}.")
    hf = _hf()
    cdir = _cache_dir(cache_dir)
    repo_id = path
    have: str | None = None  # snapshot dir of the first file, once we have it
    rev = revision
    filename = files[0]
    try:
        paths = []
        for filename in files:
            p = hf.hf_hub_download(repo_id, filename, subfolder=subfolder or None, revision=rev, token=token,
                                   cache_dir=cache_dir, local_files_only=local_files_only,
                                   library_name="focus_flex", library_version=_library_version())
            paths.append(p)
            if have is None:
                have = os.path.dirname(p)
                sha = _commit_of(have, subfolder)
                if sha is not None:
                    rev = sha  # pin the second file to the commit of the first one
    except Exception as err:  # re-raised untouched unless we know better
        new = _translate(err, repo_id=repo_id, revision=revision, subfolder=subfolder, filename=filename,
                         token=token, cache_dir=cdir, local_files_only=local_files_only, have=have)
        if new is None:
            raise
        raise new from err
    snapshot = os.path.dirname(paths[0])
    if any(os.path.dirname(p) != snapshot for p in paths):  # cannot happen with the cache layout; guard anyway
        raise IncompleteAdapterError(f"{', '.join(files)} of {repo_id!r} resolved to different folders ({paths}); "
                                     f"delete the cached repo under {cdir} and retry.")
    return snapshot


def _commit_of(snapshot_dir: str, subfolder: str | None) -> str | None:
    d = snapshot_dir
    for _ in [p for p in (subfolder or "").split("/") if p]:
        d = os.path.dirname(d)
    sha = os.path.basename(d)
    return sha if _COMMIT_SHA.match(sha) and os.path.basename(os.path.dirname(d)) == "snapshots" else None


def _library_version() -> str:
    return __version__


# ---- adapter folders ------------------------------------------------------------------------------
def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The tensor table of a safetensors file (name -> dtype/shape/data_offsets), checked for truncation.

    Pure Python (no torch): used to validate a folder before uploading it.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (only {size} bytes).")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file (header length {n} > file size {size}).")
        try:
            table = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a safetensors file (unreadable header: {e}).") from e
    if not isinstance(table, dict):
        raise ValueError(f"{path} is not a safetensors file (header is not a JSON object).")
    table.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in table.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated: its header describes {8 + n + end} bytes but the file has "
                         f"{size} (interrupted copy or download?). Re-save the adapter.")
    return table


def validate_adapter_folder(folder: str | os.PathLike) -> tuple[FocusConfig, dict[str, dict[str, Any]]]:
    """Check that ``folder`` is a complete Focus adapter folder; returns its config and tensor table."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder!r} is not a directory: `push` takes a folder written by "
                                f"`FocusAdapter.save_pretrained` (holding {CONFIG_NAME} and {WEIGHTS_NAME}).")
    _check_local_adapter_dir(folder)
    config = FocusConfig.from_json_file(os.path.join(folder, CONFIG_NAME))
    table = read_safetensors_header(os.path.join(folder, WEIGHTS_NAME))
    if not table:
        raise ValueError(f"{os.path.join(folder, WEIGHTS_NAME)} holds no tensors: nothing to share.")
    return config, table


def check_base_model(adapter_base: str | None, model_name: str | None) -> None:
    """Warn (`BaseModelMismatchWarning`) when an adapter is attached to another model than its base model.

    Names are compared case-insensitively (Hub repo ids are) and without trailing slashes; ``None`` on either
    side means "unknown" and is not warned about. Shape mismatches are errors, checked where the adapter is
    attached, not here.
    """
    if adapter_base is None or model_name is None:
        return
    a, b = str(adapter_base).rstrip("/"), str(model_name).rstrip("/")
    if a.lower() == b.lower() or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)):
        return
    warnings.warn(
        f"This Focus adapter was trained for base model {a!r} but is being attached to {b!r}. Centroids are "
        f"learned on the base model's queries and keys: unless {b!r} is a copy of {a!r} (same weights), "
        f"routing will be poor. Use the adapter with {a!r}, or train one for {b!r}.",
        BaseModelMismatchWarning, stacklevel=3)


# ---- model card -----------------------------------------------------------------------------------
_LICENSES = (("smollm2", "apache-2.0"), ("gemma", "gemma"))
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CARD_FIELDS = ("num_groups", "query_top_k", "key_top_k", "window", "sink_tokens", "tau", "block_size",
                "layers", "sinkhorn_iters", "center", "dense_decode", "dense_tail", "dense_heads", "layer_top_k",
                "num_layers", "num_kv_heads", "head_dim", "base_model", "base_model_revision", "model_type")


def _license_for(base_model: str | None, model_type: str | None) -> str | None:
    names = " ".join(x.lower() for x in (base_model, model_type) if x)
    return next((lic for key, lic in _LICENSES if key in names), None)


def _yaml_str(s: str) -> str:
    return json.dumps(s) if not re.fullmatch(r"[A-Za-z0-9][\w./-]*", s) else s


def _cell(v: Any) -> str:
    s = "`None`" if v is None else (f"`{json.dumps(v)}`" if isinstance(v, (list, dict, bool)) else str(v))
    return s.replace("|", "\\|").replace("\n", " ")


def _fill(template: str, **values: str) -> str:
    """Replace ``{name}`` placeholders we know about; any other brace (code, JSON) is left alone."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), template)


def _param_summary(cfg: dict[str, Any], shapes: dict[str, list[int]] | None) -> tuple[str, str]:
    if shapes:
        n = sum(_prod(s) for s in shapes.values())
        return f"{n:,}", ", ".join(f"`{k}` {list(s)}" for k, s in sorted(shapes.items()))
    layers = len(cfg["layers"]) if cfg.get("layers") is not None else None
    dims = [layers, cfg.get("num_kv_heads"), cfg.get("num_groups"), cfg.get("head_dim")]
    if all(d is not None for d in dims):
        n, what = _prod(dims), f"centroids {dims}: layers x KV heads x groups x head dim"
        if cfg.get("center") and cfg.get("num_query_heads"):  # centered routing: the heads' mean queries and keys
            heads = cfg["num_query_heads"] + cfg["num_kv_heads"]
            n += layers * heads * cfg["head_dim"]
            what += f"; query and key means [{layers}, {cfg['num_query_heads']} + {cfg['num_kv_heads']}, {dims[3]}]"
        return f"{n:,}", what
    return "only the", "centroids: layers x KV heads x groups x head dim"


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


REPO_PLACEHOLDER = "<namespace>/<repo>"  # in a card written before the repo id is known; filled in when pushed


def model_card(config_dict: dict[str, Any], *, repo_id: str | None, results: dict[str, Any] | None = None,
               results_markdown: str | None = None, command: str | None = None,
               tensor_shapes: dict[str, list[int]] | None = None) -> str:
    """README.md text for an adapter repo (YAML metadata + description + config + results + usage).

    ``results`` (metric -> value) becomes a table, ``results_markdown`` is inserted verbatim; when neither is
    given, ``config_dict["extra"]["results"]`` is used if present. ``command`` is shown as how the adapter was
    made. ``tensor_shapes`` (name -> shape, e.g. from the safetensors header) gives the exact parameter count.
    """
    cfg = dict(config_dict)
    base = cfg.get("base_model")
    model_type = cfg.get("model_type")
    extra = cfg.get("extra") or {}
    if results is None and results_markdown is None and isinstance(extra.get("results"), dict):
        results = extra["results"]
    hub_base = base if isinstance(base, str) and _HUB_ID.match(base) and not os.path.isabs(base) else None

    meta = ["library_name: focus_flex"]
    if hub_base:
        meta += [f"base_model: {_yaml_str(hub_base)}", "base_model_relation: adapter"]
    lic = _license_for(base, model_type)
    if lic:
        meta.append(f"license: {lic}")
    tags = ["focus-flex", "focus-attention", "sparse-attention", "flex-attention"]
    if model_type and re.fullmatch(r"[\w.-]+", model_type):
        tags.append(model_type)
    meta += ["tags:"] + [f"- {t}" for t in tags]
    meta.append("pipeline_tag: text-generation")

    rows = [f"| `{k}` | {_cell(cfg.get(k))} |" for k in _CARD_FIELDS if k in cfg]
    if "layers" in cfg and cfg["layers"] is None:
        rows = [r.replace("| `layers` | `None` |", "| `layers` | every full-attention layer |") for r in rows]
    rows += [f"| `{k}` | {_cell(v)} |" for k, v in sorted(cfg.items())
             if k not in _CARD_FIELDS and k not in ("extra", "focus_flex_version")]
    shown = {k: v for k, v in extra.items()
             if k not in ("results", "results_markdown", "command", "training", "passkey_markdown")
             and not (k == "trained_with" and isinstance(v, str) and command and v.strip() in command)}
    if shown:
        rows.append(f"| `extra` | {_cell(shown)} |")

    results_section = ""
    if results or results_markdown:
        results_section = "\n## Results\n\n"
        if results:
            results_section += "| metric | value |\n|---|---|\n" + "\n".join(
                f"| {_cell(k)} | {_cell(v)} |" for k, v in results.items()) + "\n"
        if results_markdown:
            results_section += ("\n" if results else "") + results_markdown.strip() + "\n"
    if isinstance(extra.get("passkey_markdown"), str):  # written by `focus-flex eval --task passkey`
        results_section += "\n## Long-range retrieval (passkey)\n\n" + extra["passkey_markdown"].strip() + "\n"
    command_section = ""
    if command:
        command_section = f"\n## How it was made\n\n```bash\n{command.strip()}\n```\n"
    if isinstance(extra.get("training"), dict):
        command_section += "\nTraining (`extra.training` in `focus_config.json`):\n\n| setting | value |\n|---|---|\n"
        command_section += "\n".join(f"| `{k}` | {_cell(v)} |" for k, v in extra["training"].items()) + "\n"

    num_params, shape = _param_summary(cfg, tensor_shapes)
    name = repo_id or "Focus adapter"
    template = resources.files("focus_flex").joinpath("templates", "model_card.md").read_text("utf-8")
    return _fill(
        template,
        metadata="\n".join(meta),
        title=name.split("/")[-1] if repo_id else name,
        for_base=f" for [`{hub_base}`](https://huggingface.co/{hub_base})" if hub_base
        else (f" for `{base}`" if base else ""),
        num_params=num_params,
        centroid_shape=shape,
        config_table="\n".join(rows),
        results_section=results_section,
        repo_id=repo_id or REPO_PLACEHOLDER,
        base_comment=f" ({base})" if base else "",
        command_section=command_section,
    )


# ---- pushing --------------------------------------------------------------------------------------
def _transport_errors() -> tuple[type[Exception], ...]:
    """Network-level errors of the HTTP library huggingface_hub uses (httpx up to 1.x, httpx2 from 2.0)."""
    found = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except ImportError:
            pass
    return tuple(found)


def _translate_push(err: Exception, repo_id: str, revision: str | None) -> Exception | None:
    hf = _hf()
    errors = hf.errors
    if isinstance(err, _transport_errors()):
        endpoint = hf.constants.ENDPOINT
        return HubError(f"Cannot push to {repo_id!r}: the Hub at {endpoint} cannot be reached "
                        f"({type(err).__name__}: {err}). Check the network connection and HF_ENDPOINT "
                        "(and HTTPS_PROXY behind a proxy), then push again.")
    if isinstance(err, errors.RevisionNotFoundError):
        return AdapterRevisionNotFoundError(f"Cannot push to revision {revision!r} of {repo_id!r}: it is "
                                            "not a branch. Push to a branch name (created if missing).")
    if isinstance(err, errors.RepositoryNotFoundError):
        return AdapterRepoNotFoundError(f"Cannot push to {repo_id!r}: the repo was not found for this token. "
                                        f"Check the repo id and that the token's account can see it.")
    resp = getattr(err, "response", None)
    status = getattr(resp, "status_code", None)
    if isinstance(err, errors.HfHubHTTPError) and status == 401:
        return HubAuthError(f"The Hub rejected the token while pushing to {repo_id!r} (401): it is invalid "
                            f"or expired; {_LOGIN_HINT} with a valid write token.")
    if isinstance(err, errors.HfHubHTTPError) and status == 403:
        return HubAuthError(f"The token has no write access to {repo_id!r} (403): use a write token of the "
                            f"account or organisation {repo_id.split('/')[0]!r}. "
                            f"({err.server_message or err})")
    return None


def _check_push(repo_id: str, token: str | None, revision: str | None) -> None:
    """What a push needs before any file is read or request sent: a valid repo id, a branch, a token."""
    hf = _hf()
    try:
        hf.utils.validate_repo_id(repo_id)
    except hf.errors.HFValidationError as e:
        raise ValueError(f"{repo_id!r} is not a valid Hub repo id: use 'namespace/name' (your user or "
                         f"organisation, then the repo name; letters, digits, '-', '_' and '.'). ({e})") from e
    if revision is not None and _COMMIT_SHA.match(revision):
        raise ValueError(f"revision={revision!r} is a commit sha: push to a branch (created if missing).")
    if token is False or (token is None and hf.get_token() is None):
        raise HubAuthError(f"Pushing to the Hub needs a write token: {_LOGIN_HINT}.")


def _card_bytes(folder: str, repo_id: str, card: str | None) -> bytes | None:
    """The README.md to upload (``card``, else the folder's own) naming ``repo_id``; None if there is none."""
    if card is not None:
        return card.replace(REPO_PLACEHOLDER, repo_id).encode("utf-8")
    path = os.path.join(folder, "README.md")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read().replace(REPO_PLACEHOLDER.encode(), repo_id.encode())


def push_folder_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool = False,
                       token: str | None = None, commit_message: str | None = None,
                       revision: str | None = None, create_pr: bool = False, card: str | None = None) -> str:
    """Upload every file of ``folder`` to ``repo_id`` in one commit; returns the commit URL.

    Creates the repo if needed (``private`` only applies then) and the branch ``revision`` if it does not
    exist yet (branched from ``main``). Hidden files and folders (``.cache`` etc.) are skipped. ``card`` is
    uploaded as README.md in place of the folder's own. ``folder`` is never modified: the repo-id placeholder
    of a card written before the repo was known is filled in in the uploaded copy only.
    """
    hf = _hf()
    _check_push(repo_id, token, revision)
    folder = os.fspath(folder)
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if not n.startswith("."):
                full = os.path.join(root, n)
                files.append((full, os.path.relpath(full, folder).replace(os.sep, "/")))
    if not files:
        raise FileNotFoundError(f"{folder!r} holds no files to push.")
    ops = [hf.CommitOperationAdd(path_in_repo=rel, path_or_fileobj=full) for full, rel in files
           if rel != "README.md"]
    readme = _card_bytes(folder, repo_id, card)
    if readme is not None:
        ops.append(hf.CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=readme))
    api = hf.HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, token=token)
        if revision and revision != "main" and not revision.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True, token=token)
        info = api.create_commit(repo_id, ops, commit_message=commit_message or "Upload Focus adapter",
                                 revision=revision, create_pr=create_pr, token=token)
    except Exception as err:
        new = _translate_push(err, repo_id, revision)
        if new is None:
            raise
        raise new from err
    return info.commit_url


# ---- CLI ------------------------------------------------------------------------------------------
def add_hub_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``push`` and ``pull`` on argparse sub-parsers; each sets ``func`` (args -> exit code)."""
    p = subparsers.add_parser("push", help="upload a Focus adapter folder to the Hugging Face Hub",
                              description="Validate DIR (focus_config.json + focus_adapter.safetensors) "
                                          "and upload it to REPO_ID in one commit, with a model card "
                                          "README.md naming REPO_ID (DIR's own card, or a generated one if "
                                          "it has none). DIR is not modified. Prints the commit URL.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("repo_id", metavar="REPO_ID")
    p.add_argument("--private", action="store_true", help="create the repo as private (if it does not exist)")
    p.add_argument("--token", default=None, help="Hub write token (default: HF_TOKEN or `hf auth login`)")
    p.add_argument("--revision", default=None, help="branch to push to (created if missing; default main)")
    p.add_argument("--message", default=None, help="commit message")
    p.set_defaults(func=cmd_push)

    q = subparsers.add_parser("pull", help="download a Focus adapter from the Hub and show its config",
                              description="Download REPO_ID's adapter into the Hugging Face cache (and "
                                          "copy it to --local-dir) and print where it is and its config.")
    q.add_argument("repo_id", metavar="REPO_ID")
    q.add_argument("--revision", default=None, help="branch, tag or commit sha of the adapter repo")
    q.add_argument("--subfolder", default=None)
    q.add_argument("--token", default=None)
    q.add_argument("--cache-dir", default=None)
    q.add_argument("--local-dir", default=None, metavar="DIR", help="also copy the adapter files into DIR")
    q.set_defaults(func=cmd_pull)


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 1


def cmd_push(args: argparse.Namespace) -> int:
    try:
        _check_push(args.repo_id, args.token, args.revision)
        config, table = validate_adapter_folder(args.dir)
        card = None
        if not os.path.isfile(os.path.join(args.dir, "README.md")):
            card = model_card(config.to_dict(), repo_id=args.repo_id,
                              tensor_shapes={k: v["shape"] for k, v in table.items()})
        url = push_folder_to_hub(args.dir, args.repo_id, private=args.private, token=args.token,
                                 commit_message=args.message, revision=args.revision, card=card)
    except (OSError, ValueError) as e:
        return _fail(e)
    if card is not None:
        print(f"uploaded a generated model card as README.md ({args.dir} has none; it was not written there)")
    print(url)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    try:
        path = resolve_adapter_dir(args.repo_id, revision=args.revision, subfolder=args.subfolder,
                                   token=args.token, cache_dir=args.cache_dir)
        sha = _commit_of(path, args.subfolder)
        if args.local_dir:
            os.makedirs(args.local_dir, exist_ok=True)
            for f in REQUIRED_FILES:
                shutil.copyfile(os.path.join(path, f), os.path.join(args.local_dir, f))
            path = os.path.abspath(args.local_dir)
        config = FocusConfig.from_json_file(os.path.join(path, CONFIG_NAME))
    except (OSError, ValueError) as e:
        return _fail(e)
    print(f"adapter: {path}")
    if sha:
        print(f"commit: {sha}")
    print(config.to_json_string(), end="")
    return 0


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m focus_flex.hub")
    add_hub_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # the same commands as `focus-flex push/pull`, usable without the full CLI
    sys.exit(_main())
