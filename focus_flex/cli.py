"""The ``focus-flex`` command: ``retrofit`` (train + evaluate + save), ``eval``, and the Hub's ``push``/``pull``.

    focus-flex retrofit                          # SmolLM2-135M-Instruct + shipped books, 11-17 min on 2 CPU cores
    focus-flex retrofit --model org/llm --data my_texts/ --eval-data held_out/ --context 2048
    focus-flex eval runs/retrofit-SmolLM2-135M-Instruct/adapter
    torchrun --nproc-per-node 2 -m focus_flex.cli retrofit --batch-size 2   # data parallel (also accelerate launch)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from focus_flex.config import FocusConfig
from focus_flex.evaluate import MODES, PLOT_PNG, RESULTS_JSON, RESULTS_MD, check_modes, results_markdown, save_results
from focus_flex.passkey import DEFAULT_DEPTHS, DEFAULT_LENGTHS, HAYSTACKS, PASSKEY_MODES, PHRASINGS
from focus_flex.train import TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# retrofit's pattern, chosen on a development split of the training books, then checked once on the held-out ones
# (docs/quality.md): the most groups a 64-bit mask holds, each key in its 4 best groups and a query in its best one.
DEFAULT_FOCUS = FocusConfig(num_groups=63, query_top_k=1, key_top_k=4, window=256, sink_tokens=4, tau=0.05)
DEFAULT_TRAIN = TrainConfig()


class CliError(Exception):
    """A user-facing error: printed as ``error: ...``, exit code 2."""


# ---- shared pieces ---------------------------------------------------------------------------------


def _load_model(name: str | None, revision: str | None, dtype: str, device: str) -> tuple[Any, Any]:
    from focus_flex.models import load_model

    try:
        model, tokenizer = load_model(name, dtype=DTYPES[dtype], revision=revision)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot load model {name or 'default'!r}: {e}") from e
    return model.to(device), tokenizer


def _check_context(model: Any, length: int, what: str) -> None:
    from focus_flex.models import max_context

    limit = max_context(model)
    if length > limit:
        raise CliError(f"{what}={length} is longer than the {limit} tokens {model.name_or_path!r} supports "
                       f"(config.max_position_embeddings); choose {what} <= {limit}.")


def _documents(source: str | None, split: str, role: str) -> list[str]:
    from focus_flex.data import load_documents

    try:
        return load_documents(source, split)
    except (OSError, ValueError) as e:  # FileNotFoundError and PermissionError are OSErrors
        raise CliError(f"cannot read the {role} data {source or '(shipped corpus)'!r}: {e}") from e


def _windows(docs: list[str], tokenizer: Any, length: int, max_windows: int | None, role: str) -> torch.Tensor:
    from focus_flex.data import token_windows

    try:
        return token_windows(docs, tokenizer, length, max_windows=max_windows)
    except ValueError as e:
        raise CliError(f"{role} data: {e}") from e


def _eval_source(args: argparse.Namespace, training: bool = True) -> tuple[str | None, str]:
    """Held-out documents: ``--eval-data`` if given, else the evaluation split of ``--data`` (``eval``, which
    trains nothing: all of a local ``--data``)."""
    from focus_flex.data import _is_path

    if args.eval_data is not None:
        return args.eval_data, args.eval_split or ("validation" if not _is_path(args.eval_data) else "eval")
    if args.data is not None and _is_path(args.data) and not training:
        return args.data, "eval"
    if args.data is not None and _is_path(args.data):
        raise CliError(f"--data {args.data!r} is a local path and has no held-out split: pass --eval-data with "
                       f"other files (whole documents never seen in training).")
    return args.data, args.eval_split or ("eval" if args.data is None else "validation")



def _folder(source: str) -> Path:
    """The folder a saved dataset named by ``source`` lives in, as an absolute path."""
    return Path(os.path.expanduser(source)).resolve()

def _check_disjoint(train: str | None, train_split: str, held: str | None, held_split: str) -> None:
    """Training and evaluation text must not share a document (the protocol splits by whole documents)."""
    from focus_flex.data import _is_path, _resolve_files, _saved_dataset, corpus_split

    def files(source: str | None, split: str) -> set[Path] | None:  # None: a dataset (by name or saved), by split
        try:
            if source is None:
                return {p.resolve() for p in corpus_split(split)}
            if _saved_dataset(source):
                return None
            return {p.resolve() for p in _resolve_files(source)} if _is_path(source) else None
        except (OSError, ValueError):  # reported when the data is read
            return set()

    a, b = files(train, train_split), files(held, held_split)
    if a is not None and b is not None and a & b:
        shared = sorted(a & b)
        raise CliError(f"the evaluation text shares {len(shared)} file(s) with the training text (e.g. "
                       f"{shared[0].name}): evaluate on whole documents never seen in training (--eval-data, "
                       f"--eval-split, --train-split)")
    if a is None and b is None and train_split == held_split and (train == held or _folder(train) == _folder(held)):
        raise CliError(f"--data and --eval-data are the same split {train_split!r} of {train!r}: evaluate on "
                       f"another split (--eval-split) or dataset")


def _check_modes(modes: list[str]) -> None:
    """evaluate's rule, before any model loads."""
    try:
        check_modes(modes)
    except ValueError as e:
        raise CliError(f"--modes {e}") from e


def _device(name: str) -> str:
    if name == "auto":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as e:  # (a CPU-only torch asserts on "cuda")
        raise CliError(f"--device {name!r} cannot be used here ({str(e).splitlines()[0]}); choose cpu, auto, or a "
                       "device this PyTorch build has (e.g. cuda:0).") from e
    return name


def _check_numbers(args: argparse.Namespace) -> None:
    """The evaluation flags that must be positive, before any model loads (training's: TrainConfig)."""
    for flag in ("context", "eval_windows"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name.rstrip("/").split("/")[-1]) or "model"


def _protocol(n_windows: int, context: int, source: str | None, split: str, dtype: str) -> str:
    from focus_flex.data import _is_path

    where = ("the shipped held-out books (split `eval`)" if source is None else f"`{source}`" if _is_path(source)
             else f"`{source}` (split `{split}`)")
    windows = "1 window" if n_windows == 1 else f"{n_windows} non-overlapping windows"
    return (f"Perplexity over {windows} of {context} tokens from {where}, evenly spaced, "
            f"each scored from its first token (chunked); {dtype}. Density: fraction of causal query-key pairs "
            f"computed in the Focus layers; balance: largest / mean key group.")


def _evaluate_and_save(model: Any, adapter: Any, windows: torch.Tensor, args: argparse.Namespace, directory: str,
                       protocol: str, meta: dict[str, Any], command: str) -> list:
    from focus_flex.evaluate import evaluate
    from focus_flex.hub import model_card

    results = evaluate(model, adapter, windows, modes=tuple(args.modes), progress=not args.no_progress)
    title = f"{adapter.config.base_model or 'model'}, context {windows.shape[1]}"
    markdown = results_markdown(results, protocol) + f"\n![perplexity against density]({PLOT_PNG})\n"
    adapter.config.extra.update({
        "results": {r.mode: {"perplexity": round(r.perplexity, 4), "density": round(r.density, 4)} for r in results},
        "results_markdown": markdown, "command": command})
    adapter.save_pretrained(directory)
    save_results(directory, results, meta, protocol, title)
    with open(os.path.join(directory, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(adapter.config.to_dict(), repo_id=None, results_markdown=markdown,
                           command=_how_made(adapter.config.extra)))
    print(markdown)
    return results


def _how_made(extra: dict[str, Any]) -> str | None:
    """An evaluated copy's "how it was made": the commands that trained its centroids, then the perplexity
    evaluation whose table it carries (that command may change settings, e.g. ``--layer-top-k``)."""
    made, evaluated = extra.get("trained_with"), extra.get("command")
    if made is None or evaluated in (None, made):
        return made or evaluated
    return f"{made}\n# then evaluated with:\n{evaluated}"


# ---- retrofit ---------------------------------------------------------------------------------------


def upper_half(model: torch.nn.Module, layers: list[int] | None) -> list[int]:
    """retrofit's default centering: the Focus layers (``layers``, None: every full-attention layer) in the upper half
    of the model. Measured on SmolLM2 (docs/passkey.md): uncentered groups, which follow position, serve the lower
    layers' perplexity best, centered groups, which follow content, the upper layers'."""
    from focus_flex.adapter import model_shape

    shape = model_shape(model)
    return [i for i in (shape.full_attention_layers if layers is None else layers) if i >= shape.num_layers // 2]


def cmd_retrofit(args: argparse.Namespace) -> int:
    from focus_flex.adapter import FocusAdapter
    from focus_flex.train import (
        CHECKPOINT_DIR,
        check_batch,
        check_length,
        init_distributed,
        latest_checkpoint,
        model_checksum,
        seed_everything,
        train,
    )

    t_start = time.perf_counter()
    rank, world = init_distributed()
    seed_everything(args.seed)
    _check_numbers(args)
    _check_modes(args.modes)
    if args.repetitive < 0:
        raise CliError(f"--repetitive {args.repetitive}: the number of repetitive documents must be >= 0")
    try:
        if not args.init_from:  # (else train() checks the saved adapter's window)
            check_length(args.seq_len, args.window, args.sinks)
    except ValueError as e:
        raise CliError(f"--seq-len, --window, --sinks: {e}") from e
    if args.init_from:  # the saved adapter's settings, not the Focus flags
        defaults = vars(build_parser().parse_args(["retrofit"]))
        changed = [f"--{f.replace('_', '-')}" for f in ("groups", "query_top_k", "key_top_k", "window", "sinks", "tau",
                                                         "layers", "center", "dense_decode", "dense_tail", "init")
                   if getattr(args, f) != defaults[f]]
        if changed:
            raise CliError(f"--init-from {args.init_from} starts from that adapter's centroids and Focus settings: "
                           f"drop {' '.join(changed)} (to change a setting, edit focus_config.json in a copy of the "
                           f"adapter)")
    if args.key_top_k >= args.groups:
        raise CliError(f"--key-top-k {args.key_top_k} with --groups {args.groups}: every key would join every group, "
                       f"which is full attention; pass a smaller --key-top-k (e.g. --key-top-k 1)")
    try:
        focus = FocusConfig(num_groups=args.groups, query_top_k=args.query_top_k, key_top_k=args.key_top_k,
                            window=args.window, sink_tokens=args.sinks, tau=args.tau, layers=args.layers,
                            center=True if args.center == [] else args.center or False,  # None: set below
                            dense_decode=args.dense_decode, dense_tail=args.dense_tail)
        tc = TrainConfig(objective=args.objective, steps=args.steps, batch_size=args.batch_size,
                         seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, balance_weight=args.balance_weight,
                         query_samples=args.query_samples, repeats=args.repeats, repeat_span=args.repeat_span,
                         init="keep" if args.init_from else args.init, seed=args.seed, eval_every=args.eval_every,
                         checkpoint_every=args.checkpoint_every, train_layers=args.train_layers,
                         query_mass=args.query_mass, query_most=args.query_most,
                         entropy_weight=args.entropy_weight, fisher=args.fisher)
        check_batch(tc.batch_size, world)
    except ValueError as e:
        raise CliError(f"invalid settings: {e}") from e
    eval_source, eval_split = _eval_source(args)
    if args.modes:
        _check_disjoint(args.data, args.train_split, eval_source, eval_split)
    model, tokenizer = _load_model(args.model, args.revision, args.dtype, _device(args.device))
    _check_context(model, args.seq_len, "--seq-len")
    _check_context(model, args.context, "--context")
    train_docs = _documents(args.data, args.train_split, "training")
    if args.repetitive:
        from focus_flex.data import repetitive_documents

        try:
            train_docs += repetitive_documents(train_docs, args.repetitive, tokenizer, args.seq_len, args.seed)
        except ValueError as e:
            raise CliError(f"--repetitive {args.repetitive}: {e}") from e
    train_windows = _windows(train_docs, tokenizer, args.seq_len, None, "training")
    eval_windows = None
    if args.modes and rank == 0:
        eval_windows = _windows(_documents(eval_source, eval_split, "evaluation"), tokenizer, args.context,
                                args.eval_windows, "evaluation")
    # One training window, evenly placed, is held out of training for the dev metrics (same books).
    dev = len(train_windows) // 2 if len(train_windows) > 1 else None
    dev_windows = train_windows[dev:dev + 1] if dev is not None else None
    if dev is not None:
        train_windows = torch.cat([train_windows[:dev], train_windows[dev + 1:]])

    if args.center is None:  # the default needs the model's layers
        focus.center = upper_half(model, focus.layers)
    try:
        if args.init_from:
            adapter = FocusAdapter.from_pretrained(args.init_from)
            adapter.check_compatible(model)
            adapter.config.extra = {"init_from": args.init_from}  # the results and card of the start are not this one's
        else:
            adapter = FocusAdapter.for_model(model, focus, seed=args.seed)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from e
    adapter.config.base_model_revision = args.revision
    out = args.output_dir or os.path.join("runs", f"retrofit-{_slug(adapter.config.base_model or 'model')}")
    if args.resume is None and latest_checkpoint(out) is not None:
        if not args.overwrite:
            raise CliError(f"{out!r} holds checkpoints of an earlier run: pass --resume to continue it, "
                           "--overwrite to start over in it, or another --output-dir")
        shutil.rmtree(os.path.join(out, CHECKPOINT_DIR), ignore_errors=True)  # (every rank tries: no race)
        print(f"--overwrite: removed the earlier run's checkpoints in {out}")
    before = model_checksum(model)
    t_train = time.perf_counter()
    try:
        history = train(model, adapter, train_windows, tc, dev_windows=dev_windows, output_dir=out,
                        resume=(out if args.resume is True else args.resume) or None,
                        progress=not args.no_progress, log=print)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from e
    train_seconds = time.perf_counter() - t_train
    after = model_checksum(model)
    if before != after:  # cannot happen: nothing but the centroids is ever updated
        raise RuntimeError("the base model changed during training")
    if rank != 0:
        return 0
    command = "focus-flex " + shlex.join(args.argv)
    adapter.config.extra["training"] = {**asdict(tc), "train_windows": len(train_windows),
                                        "train_seconds": round(train_seconds, 1), "world_size": world,
                                        "base_model_sha256": after, "base_model_unchanged": True,
                                        "dev": history[-1].get("dev") if history else None}
    directory = os.path.join(out, "adapter")
    meta: dict[str, Any] = {"command": command, "focus_config": adapter.config.to_dict(), "history": history}
    if eval_windows is not None:
        protocol = _protocol(len(eval_windows), args.context, eval_source, eval_split, args.dtype)
        _evaluate_and_save(model, adapter, eval_windows, args, directory, protocol, meta, command)
    else:  # no evaluation: no results, and none left from an earlier run in this folder
        from focus_flex.hub import model_card

        adapter.save_pretrained(directory)
        for name in (RESULTS_JSON, RESULTS_MD, PLOT_PNG):
            if os.path.exists(os.path.join(directory, name)):
                os.remove(os.path.join(directory, name))
        with open(os.path.join(directory, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(adapter.config.to_dict(), repo_id=None, command=command))
    total = time.perf_counter() - t_start
    adapter.config.extra["training"]["total_seconds"] = round(total, 1)
    adapter.config.save_pretrained(directory)
    print(f"adapter: {directory}  (training {train_seconds:.0f} s, total {total:.0f} s; base model unchanged, "
          f"sha256 {after[:12]})")
    return 0


# ---- eval -------------------------------------------------------------------------------------------


def cmd_eval(args: argparse.Namespace) -> int:
    from focus_flex.adapter import FocusAdapter

    try:
        adapter = FocusAdapter.from_pretrained(args.adapter)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot load adapter {args.adapter!r}: {e}") from e
    _check_numbers(args)
    known = MODES if args.task == "perplexity" else PASSKEY_MODES
    if args.modes is None:  # each task's own default: all of its modes
        args.modes = list(known)
    if not args.modes:
        raise CliError(f"--modes needs at least one of {', '.join(known)}")
    if args.task == "passkey":
        _check_passkey_flags(args)
    else:
        _check_modes(args.modes)
    for flag, field in (("--query-top-k", "query_top_k"), ("--key-top-k", "key_top_k"), ("--window", "window"),
                        ("--sinks", "sink_tokens"), ("--dense-decode", "dense_decode"),
                        ("--dense-tail", "dense_tail"), ("--dense-heads", "dense_heads"),
                        ("--layer-top-k", "layer_top_k")):
        value = getattr(args, field)
        if value is not None:
            setattr(adapter.config, field, value)
            try:
                adapter.config.validate()
            except ValueError as e:
                hint = {"window": "choose a window >= 1 token", "sink_tokens": "choose 0 or more sink tokens",
                        "dense_tail": "choose 0 or more queries",
                        "dense_heads": f"name Focus layers {adapter.config.layers} and KV heads below "
                                       f"{adapter.config.num_kv_heads}",
                        "layer_top_k": f"name each of the Focus layers {adapter.config.layers} once, with top-k 1 to "
                                       f"{adapter.config.num_groups}"}.get(
                    field, f"the adapter has {adapter.config.num_groups} groups per KV head; choose 1 to "
                           f"{adapter.config.num_groups}")
                raise CliError(f"{flag} {value}: {hint} ({e}).") from e
    if args.task == "passkey":
        return _eval_passkey(args, adapter)
    eval_source, eval_split = _eval_source(args, training=False)
    name = args.model or adapter.config.base_model
    model, tokenizer = _load_model(name, args.revision or adapter.config.base_model_revision, args.dtype,
                                   _device(args.device))
    _check_context(model, args.context, "--context")
    windows = _windows(_documents(eval_source, eval_split, "evaluation"), tokenizer, args.context,
                       args.eval_windows, "evaluation")
    try:
        adapter.check_compatible(model)
    except ValueError as e:
        raise CliError(str(e)) from e
    out = _eval_output_dir(args)
    command = "focus-flex " + shlex.join(args.argv)
    extra = adapter.config.extra
    extra.setdefault("trained_with", extra.get("command"))
    protocol = _protocol(len(windows), args.context, eval_source, eval_split, args.dtype)
    _evaluate_and_save(model, adapter, windows, args, out, protocol, {"command": command,
                       "adapter": args.adapter, "focus_config": adapter.config.to_dict()}, command)
    print(f"results: {out}")
    return 0


def _eval_output_dir(args: argparse.Namespace) -> str:
    where = os.path.abspath(args.adapter) if os.path.isdir(args.adapter) else args.adapter
    parent, name = os.path.split(where.rstrip("/"))  # retrofit saves every adapter as .../RUN/adapter
    return args.output_dir or os.path.join("runs", f"eval-{_slug(parent)}-{_slug(name)}")


def _check_passkey_flags(args: argparse.Namespace) -> None:
    """The passkey flags that need no model, checked before any model loads (lengths: after, against its context)."""
    wrong = sorted(set(args.modes) - set(PASSKEY_MODES))
    if wrong:
        raise CliError(f"--modes {wrong}: --task passkey runs {', '.join(PASSKEY_MODES)}")
    if "window" in args.modes and "focus" not in args.modes:
        raise CliError("--modes window needs focus too (its window is set so that its density matches focus's)")
    bad = [d for d in args.depths if not 0 <= d <= 100]
    if bad:
        raise CliError(f"--depths {bad}: a depth is a percentage of the haystack, 0 to 100")
    if args.keys_per_cell < 1:
        raise CliError(f"--keys-per-cell {args.keys_per_cell}: must be >= 1")


def _eval_passkey(args: argparse.Namespace, adapter: Any) -> int:
    """``eval --task passkey``: retrieval of full attention, Focus and the window at Focus's density.

    The results so far are saved after every prompt (``passkey.partial.json`` in the output folder), so that an
    interrupted run continues with ``--resume``; the finished run replaces them with its report.
    """
    from focus_flex.hub import model_card
    from focus_flex.passkey import (
        PASSKEY_MD,
        PASSKEY_PARTIAL,
        check_passkey_args,
        passkey_eval,
        passkey_protocol,
        save_passkey,
        write_passkey_json,
    )

    out = _eval_output_dir(args)
    partial = os.path.join(out, PASSKEY_PARTIAL)
    if os.path.exists(partial) and os.path.realpath(partial) not in map(os.path.realpath, args.resume or []):
        raise CliError(f"{out!r} holds the results of an unfinished run ({partial}): continue it by passing "
                       f"--resume {partial} (with any other files to resume from), or choose another --output-dir")
    config = adapter.config.to_dict()
    earlier = _resumed(args, config) if args.resume else []
    name, revision = _base_model(config, args.model, args.revision)
    model, tokenizer = _load_model(name, revision, args.dtype, _device(args.device))
    try:
        adapter.check_compatible(model)
        check_passkey_args(model, args.lengths, args.depths, args.keys_per_cell, args.haystacks, args.modes,
                           args.phrasings)
    except ValueError as e:
        raise CliError(str(e).replace("length ", "--lengths ", 1)) from e
    command = "focus-flex " + shlex.join(args.argv)
    # the configuration evaluated, without the retrieval table of the card it was read from (not this run's)
    evaluated = {**config, "extra": {k: v for k, v in config["extra"].items() if k != "passkey_markdown"}}
    meta = {"command": command, "adapter": args.adapter, "focus_config": evaluated, "cpu": _cpu_name(),
            "dtype": args.dtype, "model": name, "revision": revision}
    protocol = passkey_protocol(args.dtype, adapter.config.dense_decode, adapter.config.dense_tail,
                                adapter.config.dense_heads, args.phrasings, adapter.config.layer_top_k)
    results = _reused_full(args) if args.full_results else []  # in the report whatever --modes says
    n_full = len(results)
    modes = [m for m in args.modes if not (results and m == "full")]

    def save_so_far(so_far: list) -> None:
        # with the earlier results not taken (yet): --resume may have named this very file; without --full-results's
        # rows, which the same command reads again
        taken = {id(r) for r in so_far}
        write_passkey_json(partial, so_far + [r for r in earlier if id(r) not in taken], meta, protocol)

    if modes:
        os.makedirs(out, exist_ok=True)  # for the results so far
        try:
            results += passkey_eval(model, tokenizer, adapter, args.lengths, args.depths, args.keys_per_cell,
                                    args.haystacks, modes, args.phrasings, seed=args.seed,
                                    progress=not args.no_progress, earlier=earlier, on_result=save_so_far)
        except BaseException:  # Ctrl-C or an error: say where what was done is kept
            if os.path.exists(partial):
                print(f"stopped: the results so far are in {partial}; continue with --resume {partial}",
                      file=sys.stderr)
            raise
    if earlier:
        reused = {id(r) for r in earlier}
        taken = sum(id(r) in reused for r in results)
        given = f", {n_full} from --full-results" if n_full else ""
        print(f"--resume: {taken} of {len(results)} results taken from {' '.join(args.resume)}{given}, "
              f"{len(results) - taken - n_full} run")
    paths = save_passkey(out, results, meta, protocol)
    # The evaluated copy of the adapter: its card shows the retrieval table and heatmaps next to its perplexity.
    extra = adapter.config.extra
    extra.setdefault("trained_with", extra.get("command"))
    with open(paths[PASSKEY_MD], encoding="utf-8") as f:
        heatmaps = "".join(f"\n![passkey, {name[8:-4]}]({name})\n" for name in paths if name.endswith(".png"))
        # the card's command reproduces the results without the earlier runs it resumed (a reader does not have them)
        rerun = "focus-flex " + shlex.join(_without(args.argv, "--resume"))
        extra["passkey_markdown"] = f.read() + heatmaps + f"\n```bash\n{rerun}\n```\n"
    adapter.save_pretrained(out)
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(adapter.config.to_dict(), repo_id=None, results_markdown=extra.get("results_markdown"),
                           command=_how_made(extra)))
    if os.path.exists(partial):
        os.remove(partial)
    print(f"results: {out}")
    return 0


def _reused_full(args: argparse.Namespace) -> list:
    """The full-attention results of ``--full-results`` for exactly the prompts this run asks for.

    Several files may each hold some of the prompts; where two hold the same prompt, the first named wins.
    """
    from focus_flex.passkey import load_passkey, prompts_of

    earlier = {}
    for path in args.full_results:
        try:
            for r in load_passkey(path):
                if r.mode == "full":
                    earlier.setdefault(r.prompt, r)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise CliError(f"--full-results {path!r}: not a readable passkey.json ({e})") from e
    cells = prompts_of(args.haystacks, args.lengths, args.depths, args.keys_per_cell, args.phrasings)
    missing = [c for c in cells if c not in earlier or earlier[c].key != c.key(args.seed)]
    if missing:
        held = sorted({c.phrasing for c in earlier})
        raise CliError(f"--full-results {' '.join(args.full_results)} has no full-attention result for {len(missing)} "
                       f"of the {len(cells)} prompts asked for (e.g. {missing[0]}, --seed {args.seed}); run full "
                       f"attention for them (drop --full-results), or ask for the phrasings it holds (--phrasings "
                       f"{' '.join(held)})")
    return [earlier[c] for c in cells]


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and the values that follow it."""
    out, skipping = [], False
    for a in argv:
        skipping = a == flag or (skipping and not a.startswith("-"))
        if not skipping:
            out.append(a)
    return out


def _base_model(config: dict[str, Any], model: str | None = None,
                revision: str | None = None) -> tuple[str | None, str | None]:
    """The model (Hub id or folder) and revision an evaluation runs: ``model``/``revision`` (``--model``,
    ``--revision``), else those of the adapter ``config``."""
    return model or config.get("base_model"), revision or config.get("base_model_revision")


def _resumed(args: argparse.Namespace, config: dict[str, Any]) -> list:
    """The results of ``--resume``: earlier runs of this adapter configuration (its centroids aside), model and
    dtype."""
    from focus_flex.passkey import PasskeyResult

    mine = {k: v for k, v in config.items() if k != "extra"}
    here = _base_model(config, args.model, args.revision)
    earlier = []
    for path in args.resume:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            rows = [PasskeyResult(**r) for r in data["results"]]
            theirs = {k: v for k, v in data["focus_config"].items() if k != "extra"}
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise CliError(f"--resume {path!r}: not a readable passkey.json ({e})") from e
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            raise CliError(f"--resume {path!r} was run with another configuration (it differs in "
                           + ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
                           + "); resume runs of this configuration only (--full-results takes full attention's "
                           "answers from any run)")
        # runs before the dtype was recorded name it in their protocol paragraph
        dtype = data.get("dtype") or next((d for d in DTYPES if f"; {d}. " in data.get("protocol", "")), None)
        if dtype is None:
            raise CliError(f"--resume {path!r}: its dtype is not recorded; run its prompts again")
        if dtype != args.dtype:
            raise CliError(f"--resume {path!r} was run in {dtype}, this run in {args.dtype}: resume it with "
                           f"--dtype {dtype}")
        # runs before the model was recorded ran the adapter's base model (unless told otherwise, unknowable)
        run_on = (data["model"], data.get("revision")) if "model" in data else _base_model(data["focus_config"])
        if run_on != here:
            raise CliError(f"--resume {path!r} was run on the model {run_on[0]!r} (revision {run_on[1]!r}), this run "
                           f"on {here[0]!r} (revision {here[1]!r}): resume runs of the same --model and --revision")
        earlier += rows
    return earlier


def _cpu_name() -> str | None:
    """The CPU's model name (Linux), recorded with timings."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


# ---- parser -----------------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, training: bool) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="Hub id or local folder (default: SmolLM2-135M-Instruct, embedded)")
    g.add_argument("--revision", default=None, help="revision of the base model")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    g.add_argument("--data", default=None,
                   help=("training text" if training else "text to evaluate on (a dataset's evaluation split; all of "
                         "a local path)") + ": a datasets name, a text file, a folder of *.txt or a glob (one "
                        "document per file), a .jsonl/.csv/.tsv/.parquet/.arrow file or a save_to_disk folder (its "
                        "'text' column) (default: the shipped public-domain books)")
    g.add_argument("--eval-data", default=None,
                   help="held-out text, same forms as --data (default: the evaluation split of --data)")
    g.add_argument("--eval-split", default=None,
                   help="split of the evaluation data (default: 'eval' for the shipped books, else 'validation')")
    g.add_argument("--context", type=int, default=4096, help="evaluation context length in tokens")
    g.add_argument("--eval-windows", type=int, default=4, help="evaluation windows (evenly spaced, fixed)")
    g.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES),
                   help="what to evaluate (default: all five; --modes with no value: skip evaluation)")
    g.add_argument("--output-dir", default=None)
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="focus-flex", description="Focus sparse attention adapters: train, "
                                     "evaluate and share learned-centroid routing for frozen transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser("retrofit", help="train centroids on a frozen model, evaluate, save the adapter",
                       description="Train only the centroids of a Focus adapter on a frozen model, evaluate "
                                   "perplexity against full attention and window-only and random-groups baselines at "
                                   "the same density, and save the adapter with its results, model card and plot "
                                   "into OUTPUT_DIR/adapter.")
    _add_common(r, training=True)
    f = r.add_argument_group("Focus")
    d = DEFAULT_FOCUS
    f.add_argument("--groups", type=int, default=d.num_groups, help="centroids (groups) per KV head")
    f.add_argument("--query-top-k", type=int, default=d.query_top_k, help="groups each query joins")
    f.add_argument("--key-top-k", type=int, default=d.key_top_k,
                   help="groups each key joins (with --groups G, about k/G of the far keys stay)")
    f.add_argument("--window", type=int, default=d.window, help="sliding window (tokens)")
    f.add_argument("--sinks", type=int, default=d.sink_tokens, help="attention sink tokens")
    f.add_argument("--tau", type=float, default=d.tau, help="routing temperature (soft path sharpness)")
    f.add_argument("--layers", type=int, nargs="+", default=None, help="Focus layers (default: all full-attention)")
    f.add_argument("--center", type=int, nargs="*", metavar="LAYER", default=None,
                   help="route queries and keys with their head's mean removed: in the LAYERs given, or without LAYER "
                        "in every Focus layer (default: the Focus layers in the upper half of the model, groups by "
                        "content there and by position below; docs/passkey.md)")
    f.add_argument("--no-center", dest="center", action="store_const", const=False,
                   help="route every layer's queries and keys as they are")
    f.add_argument("--dense-decode", action=argparse.BooleanOptionalAction, default=d.dense_decode,
                   help="decode steps attend every earlier token: Focus for the prefill only (docs/passkey.md)")
    f.add_argument("--dense-tail", type=int, default=d.dense_tail, metavar="N",
                   help="the last N queries of a prefill (the question at the end of a prompt) attend every earlier "
                        "token (docs/passkey.md)")
    t = r.add_argument_group("training")
    c = DEFAULT_TRAIN
    t.add_argument("--objective", choices=["distill", "lm", "kd"], default=c.objective,
                   help="distill: each layer's attention output (layer-local); lm: next-token loss; kd: KL from the "
                        "model's own next-token distribution (end to end, soft routing; docs/passkey.md)")
    t.add_argument("--steps", type=int, default=c.steps)
    t.add_argument("--batch-size", type=int, default=c.batch_size, help="global sequences per step")
    t.add_argument("--seq-len", type=int, default=c.seq_len, help="training sequence length")
    t.add_argument("--lr", type=float, default=c.lr)
    t.add_argument("--warmup", type=int, default=c.warmup)
    t.add_argument("--balance-weight", type=float, default=c.balance_weight)
    t.add_argument("--query-samples", type=int, default=c.query_samples, help="distill: attention rows per layer")
    t.add_argument("--repeats", type=int, default=c.repeats,
                   help="distill, kd: spans copied far ahead into each training sequence, half the rows (distill) or "
                        "half the loss (kd) read them back")
    t.add_argument("--repeat-span", type=int, default=c.repeat_span, help="tokens per copied span")
    t.add_argument("--repetitive", type=int, default=0, metavar="N",
                   help="add N documents of repetitive training text (a few sentences of the training data repeated, "
                        "other sentences among the copies) to the training data: far attention over repetition, as "
                        "in a passkey haystack (docs/passkey.md, point 39)")
    t.add_argument("--init", choices=["kmeans", "random"], default=c.init)
    t.add_argument("--init-from", metavar="ADAPTER", default=None,
                   help="fine-tune a saved adapter (folder or Hub id): start from its centroids, means and Focus "
                        "settings")
    t.add_argument("--train-layers", type=int, nargs="+", default=None, metavar="LAYER",
                   help="train only these Focus layers' centroids; the others stay as they start (with --init-from: "
                        "as saved; docs/passkey.md, point 41)")
    t.add_argument("--query-mass", type=float, default=None, metavar="P",
                   help="distill: each query's soft top-k takes its likeliest groups until they hold P of its routing "
                        "probability (at most --query-most) instead of --query-top-k; the saved adapter still routes "
                        "hard top-k (benchmarks.passkey_oracle --adaptive-mass evaluates it so; docs/passkey.md, "
                        "point 50)")
    t.add_argument("--query-most", type=int, default=c.query_most, help="--query-mass: at most this many groups")
    t.add_argument("--entropy-weight", type=float, default=c.entropy_weight,
                   help="--query-mass: add this times the queries' routing entropy to the loss, so that a query does "
                        "not take more groups by routing flatter (docs/passkey.md, point 50)")
    t.add_argument("--fisher", action="store_true",
                   help="distill: draw the rows of each layer and weight its heads by the Fisher weight of their "
                        "attention output (how much an error there moves the model's output, through every later "
                        "layer; one backward pass of the model per sequence; docs/passkey.md, point 51)")
    t.add_argument("--seed", type=int, default=c.seed)
    t.add_argument("--eval-every", type=int, default=c.eval_every, help="dev metrics every N steps")
    t.add_argument("--checkpoint-every", type=int, default=c.checkpoint_every)
    t.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="resume from the latest checkpoint in OUTPUT_DIR (or from CHECKPOINT)")
    t.add_argument("--overwrite", action="store_true",
                   help="start over in an OUTPUT_DIR that holds an earlier run's checkpoints (they are deleted)")
    t.add_argument("--train-split", default="train")
    r.set_defaults(func=cmd_retrofit)

    e = sub.add_parser("eval", help="evaluate a saved adapter", description="Perplexity / density / balance of "
                       "ADAPTER (folder or Hub id) against full attention and window-only and random-groups "
                       "baselines at the same density.")
    e.add_argument("adapter", metavar="ADAPTER")
    k = e.add_argument_group("routing at inference (the same centroids; more groups per token, more far pairs)")
    k.add_argument("--query-top-k", type=int, default=None, help="groups each query joins (default: the adapter's)")
    k.add_argument("--key-top-k", type=int, default=None, help="groups each key joins (default: the adapter's)")
    k.add_argument("--window", type=int, default=None, help="sliding window (tokens; default: the adapter's)")
    k.add_argument("--sinks", dest="sink_tokens", type=int, default=None,
                   help="first tokens every query attends (default: the adapter's)")
    k.add_argument("--dense-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps attend every earlier token (default: the adapter's; docs/passkey.md)")
    k.add_argument("--dense-tail", type=int, default=None, metavar="N",
                   help="the last N queries of a prefill attend every earlier token (default: the adapter's)")
    k.add_argument("--dense-heads", type=layer_head, nargs="*", default=None, metavar="LAYER.KV_HEAD",
                   help="KV heads whose query heads attend every earlier token, e.g. 4.0 5.0 6.0 (default: the "
                        "adapter's; with none given: no dense heads; docs/passkey.md)")
    k.add_argument("--layer-top-k", type=layer_top_k, nargs="*", default=None, metavar="LAYER:Q:K",
                   help="Focus layers that route their queries into Q groups and keys into K, e.g. 0:32:4 2:32:4 "
                        "(default: the adapter's; with none given: every layer the same; docs/passkey.md)")
    e.add_argument("--task", choices=["perplexity", "passkey"], default="perplexity",
                   help="perplexity on held-out text (default), or passkey retrieval (docs/passkey.md)")
    pk = e.add_argument_group("passkey retrieval (--task passkey)")
    pk.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="prompt lengths (tokens)")
    pk.add_argument("--depths", type=int, nargs="+", default=list(DEFAULT_DEPTHS),
                    help="needle depths (%% of the haystack)")
    pk.add_argument("--keys-per-cell", type=int, default=2, help="keys per (haystack, length, depth)")
    pk.add_argument("--haystacks", nargs="+", choices=list(HAYSTACKS), default=list(HAYSTACKS))
    pk.add_argument("--phrasings", nargs="+", choices=list(PHRASINGS), default=list(PHRASINGS),
                    help="words around the haystack: the passkey's, RULER's needle-in-a-haystack")
    pk.add_argument("--seed", type=int, default=0, help="seed of the keys")
    pk.add_argument("--full-results", metavar="PASSKEY_JSON", nargs="+", default=None,
                    help="reuse the full-attention results of earlier runs (their passkey.json files, together "
                         "holding this run's prompts; the first named wins) instead of running full attention again; "
                         "they join this run's report with any --modes, so each mode is compared with full attention")
    pk.add_argument("--resume", metavar="PASSKEY_JSON", nargs="+", default=None,
                    help="take the results of earlier runs of this same adapter configuration, model and dtype (their "
                         "passkey.json files) for the prompts and modes they hold, and run only the rest")
    _add_common(e, training=False)
    e.set_defaults(func=cmd_eval, modes=None)  # --modes default: all of the task's modes

    from focus_flex.hub import add_hub_commands

    add_hub_commands(sub)
    return parser


def layer_head(text: str) -> list[int]:
    """``"4.0"`` -> ``[4, 0]``: a ``LAYER.KV_HEAD`` argument (``FocusConfig.dense_heads``)."""
    layer, _, head = text.partition(".")
    if not (layer.isdigit() and head.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER.KV_HEAD, e.g. 4.0 (KV head 0 of layer 4)")
    return [int(layer), int(head)]


def layer_top_k(text: str) -> list[int]:
    """``"0:32:4"`` -> ``[0, 32, 4]``: a ``LAYER:Q:K`` argument (``FocusConfig.layer_top_k``)."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER:Q:K, e.g. 0:32:4 (layer 0 routes each query into "
                                         "32 groups and each key into 4)")
    return [int(p) for p in parts]


def keep_freed_memory() -> bool:
    """Linux/glibc: keep freed buffers in the process heap instead of returning each to the OS.

    Training and evaluation allocate and free many ``[heads, L, L]`` temporaries (tens of MB); by default glibc
    serves each from a fresh ``mmap`` whose pages are faulted in and zeroed again every time (docs/speed.md,
    "Allocator").
    Only the ``focus-flex`` process is affected; returns whether the setting was applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 31))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    keep_freed_memory()
    try:
        return args.func(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
