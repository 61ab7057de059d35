"""Passkey retrieval: does attention still find one fact planted far back in a long context?

Protocol (Mohtashami & Jaggi, 2023, adapted to an instruct model; docs/passkey.md has the reasoning):

* **Key.** Five random digits ``10000-99999`` (``random.Random`` seeded by haystack, length, depth and key number, so
  every mode and phrasing sees the same keys).
* **Phrasings** (:data:`PHRASINGS`: instruction, needle, question and started answer). ``passkey``: the needle
  ``" The pass key is 71432. Remember it. 71432 is the pass key."``; ``ruler``: RULER's single-needle wording
  (Hsieh et al., 2024), ``" One of the special magic numbers for quiet-harbor is: 71432."``. Both phrasings of a
  cell hide the same key at the same place of the same haystack.
* **Haystacks.** ``filler``: the classic ``"The grass is green. The sky is blue. ..."`` repeated; ``prose``: a
  contiguous excerpt of the held-out books of the shipped corpus (split ``eval``, never used in training), a
  different excerpt for every key.
* **Prompt** (exactly ``length`` tokens, the model's chat template, one user turn and the start of the answer)::

      <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n{INSTRUCTION}{haystack with needle}{QUESTION}<|im_end|>\\n
      <|im_start|>assistant\\n{ANSWER_PREFIX}

  Models without a chat template get ``{INSTRUCTION}{haystack}{QUESTION}\\n{ANSWER_PREFIX}``.
* **Depth.** The needle starts at (the sentence boundary nearest to) ``depth`` % of the haystack's tokens.
* **Scoring.** Greedy decoding (KV cache) of up to :data:`MAX_NEW_TOKENS` tokens; correct iff the first run of
  digits in the answer is exactly the key. Besides, the key's log-probability (``" " + key`` teacher-forced on the
  same path: the prefill's last logits, then decode steps): a measure of retrieval that a near tie between the key
  and another answer does not flip.
* **Modes.** ``full``: the model's own attention. ``focus``: the adapter attached, hard routing (inference path,
  prefill and decode). ``window``: window + sinks only, the window set so that its density over ``length`` tokens
  matches ``focus``'s density measured on the prefills of the same haystack, phrasing and length
  (:func:`focus_flex.evaluate.matching_window`); with the adapter's ``dense_decode``, window-only's decode steps
  attend every earlier token too, and with its ``dense_tail`` the last queries of its prefill.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import StoppingCriteria

from focus_flex.adapter import FocusAdapter, has_focus
from focus_flex.evaluate import RoutingMeter, matching_window, window_density, window_only
from focus_flex.models import max_context

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("filler", "prose")
PASSKEY_MODES = ("full", "focus", "window")
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"
MAX_NEW_TOKENS = 8  # " 7 1 4 3 2 ." and a margin: the key's digits are single tokens in SmolLM2's vocabulary
DEFAULT_LENGTHS, DEFAULT_DEPTHS = (2048, 4096), (10, 50, 90)
PASSKEY_JSON, PASSKEY_MD = "passkey.json", "passkey.md"
PASSKEY_PARTIAL = "passkey.partial.json"  # the results so far of a run not finished, for ``--resume``
SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")


@dataclass(frozen=True)
class PromptText:
    """The words of a retrieval prompt around its haystack; ``needle`` holds ``{key}`` where the key goes."""

    instruction: str = INSTRUCTION
    needle: str = NEEDLE
    question: str = QUESTION
    answer_prefix: str = ANSWER_PREFIX


RULER_NAME = "quiet-harbor"  # RULER draws an adjective-noun word per sample; one fixed word here
PHRASINGS = {
    "passkey": PromptText(),  # Mohtashami & Jaggi (2023)
    # RULER's single-needle NIAH (Hsieh et al., 2024) with the passkey's 5-digit key; its started answer goes on as
    # SmolLM2 with full attention goes on (":\n\n- 71432", a list item), so the first generated tokens are the key
    "ruler": PromptText(
        instruction="Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                    "I will quiz you about the numbers afterwards.\n",
        needle=f" One of the special magic numbers for {RULER_NAME} is: {{key}}.",
        question=f"\nWhat are all the special magic numbers for {RULER_NAME} mentioned in the provided text?",
        answer_prefix=f"The special magic numbers for {RULER_NAME} mentioned in the provided text is:\n\n-"),
}


@dataclass
class PasskeyPrompt:
    """One prompt: ``input_ids [length]``, the key, and where the needle and the key's digits are (token indices)."""

    input_ids: torch.Tensor
    key: str
    needle: tuple[int, int]  # [start, end) of the needle's tokens in input_ids
    key_tokens: list[int]  # positions of the first copy of the key's tokens
    depth: float  # where the needle starts, in % of the haystack's tokens


@dataclass
class PasskeyResult:
    """One key of one cell in one mode."""

    mode: str
    haystack: str
    length: int
    depth: int  # requested depth (%)
    key_number: int
    key: str
    answer: str
    correct: bool
    needle_depth: float  # actual depth of the needle start (% of the haystack)
    density: float  # fraction of causal pairs computed in the prefill (Focus layers)
    seconds: float
    key_logprob: float | None = None  # log p(" " + key | prompt), nats (None: not measured, results of older runs)
    first_logprob: float | None = None  # the part of key_logprob on the key's first token (SmolLM2: the space)
    phrasing: str = "passkey"  # a key of PHRASINGS (results of older runs: the passkey's)

    @property
    def prompt(self) -> Prompt:
        """Which prompt this result answers; its tokens: ``self.prompt.build(tokenizer, self.key)``."""
        return Prompt(self.haystack, self.length, self.depth, self.key_number, self.phrasing)


# ---- prompts -------------------------------------------------------------------------------------


def make_key(haystack: str, length: int, depth: int, number: int, seed: int = 0) -> str:
    """The 5-digit key of one cell and key number (the same in every mode)."""
    return str(random.Random(f"{seed}/{haystack}/{length}/{depth}/{number}").randint(10000, 99999))


class Prompt(NamedTuple):
    """Which prompt of an evaluation: haystack, length, depth (%), key number and phrasing."""

    haystack: str
    length: int
    depth: int
    number: int
    phrasing: str

    def key(self, seed: int = 0) -> str:
        """The prompt's key: the same for every mode and phrasing."""
        return make_key(self.haystack, self.length, self.depth, self.number, seed)

    def build(self, tokenizer: Any, key: str) -> PasskeyPrompt:
        """The prompt's tokens, hiding ``key`` (normally ``self.key(seed)``), in its phrasing's words."""
        return build_prompt(tokenizer, self.length, self.depth, key, self.haystack, self.number,
                            PHRASINGS[self.phrasing])


def prompts_of(haystacks: list[str] | tuple[str, ...], lengths: list[int] | tuple[int, ...],
               depths: list[int] | tuple[int, ...], keys_per_cell: int,
               phrasings: list[str] | tuple[str, ...]) -> list[Prompt]:
    """Every prompt an evaluation with these arguments asks."""
    return [Prompt(h, n, d, k, p) for h in haystacks for n in lengths for d in depths for k in range(keys_per_cell)
            for p in phrasings]


def _wrap(tokenizer: Any, answer_prefix: str = ANSWER_PREFIX) -> tuple[str, str]:
    """Text before and after a user message: the chat template's user turn, then the assistant's answer started
    with ``answer_prefix``."""
    marker = "\x00BODY\x00"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
        before, after = text.split(marker)
        return before, after + answer_prefix
    return "", "\n" + answer_prefix


def haystack_ids(tokenizer: Any, haystack: str, n: int, number: int = 0) -> list[int]:
    """``n`` token ids of haystack text: the filler repeated, or the ``number``-th excerpt of the held-out books."""
    if haystack == "filler":
        one = tokenizer(" " + FILLER, add_special_tokens=False)["input_ids"]
        return (one * (n // len(one) + 1))[:n]
    if haystack != "prose":
        raise ValueError(f"haystack {haystack!r} unknown: choose from {HAYSTACKS}")
    ids = _book_ids(tokenizer, "eval")
    if len(ids) < n:
        raise ValueError(f"the held-out books hold {len(ids)} tokens, fewer than the {n} asked for")
    start = (number * 7919 * 64) % (len(ids) - n - 63)  # different excerpts for different keys, deterministic
    start = _next_boundary(tokenizer, ids, start)  # from the start of a sentence
    return ids[start:start + n]


_BOOKS: dict[tuple[int, str], list[int]] = {}


def _book_ids(tokenizer: Any, split: str) -> list[int]:
    """Token ids of the shipped books of ``split`` (``"eval"``: held out), concatenated (cached per tokenizer)."""
    if (id(tokenizer), split) not in _BOOKS:
        from focus_flex.data import load_documents

        docs = [" ".join(doc.split()) for doc in load_documents(None, split)]  # one line: no hard-wrap newlines
        ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        _BOOKS[id(tokenizer), split] = [t for doc in ids for t in doc]
    return _BOOKS[id(tokenizer), split]


def build_prompt(tokenizer: Any, length: int, depth: float, key: str, haystack: str = "filler",
                 number: int = 0, text: PromptText = PromptText()) -> PasskeyPrompt:
    """A prompt of exactly ``length`` tokens with the needle at ``depth`` % of the haystack (module docstring);
    ``text``: other words around the haystack than the passkey's."""
    if not 0 <= depth <= 100:
        raise ValueError(f"depth {depth} is outside 0-100 (% of the haystack)")
    if "{key}" not in text.needle:
        raise ValueError(f"the needle {text.needle!r} has no '{{key}}' where the key goes")
    before, after = _wrap(tokenizer, text.answer_prefix)
    head = tokenizer(before + text.instruction, add_special_tokens=False)["input_ids"]
    tail = tokenizer(text.question + after, add_special_tokens=False)["input_ids"]
    enc = tokenizer(text.needle.format(key=key), add_special_tokens=False, return_offsets_mapping=True)
    needle, offsets = enc["input_ids"], enc["offset_mapping"]
    n = length - len(head) - len(tail) - len(needle)
    if n < 1:
        raise ValueError(f"length {length} leaves no room for a haystack (the prompt's fixed parts take "
                         f"{length - n} tokens)")
    hay = haystack_ids(tokenizer, haystack, n, number)
    at = _nearest_boundary(tokenizer, hay, round(depth / 100 * n))
    ids = head + hay[:at] + needle + hay[at:] + tail
    first = text.needle.format(key=key).index(key)
    key_tokens = [len(head) + at + i for i, (s, e) in enumerate(offsets) if s < first + len(key) and e > first]
    return PasskeyPrompt(torch.tensor(ids), key, (len(head) + at, len(head) + at + len(needle)), key_tokens,
                         100 * at / n)


def _next_boundary(tokenizer: Any, ids: list[int], start: int, reach: int = 64) -> int:
    """The first position at or after ``start`` (within ``reach`` tokens) right after a sentence end."""
    return next((at for at in range(start, start + reach) if at == 0 or SENTENCE_END.search(
        tokenizer.decode(ids[at - 1:at]))), start)


def _nearest_boundary(tokenizer: Any, ids: list[int], target: int, reach: int = 64) -> int:
    """The position nearest ``target`` (within ``reach`` tokens) right after a sentence end, else ``target``."""
    for delta in range(reach + 1):
        for at in (target - delta, target + delta):
            if at == 0 or at == len(ids):
                return at
            if 0 < at < len(ids) and SENTENCE_END.search(tokenizer.decode(ids[at - 1:at])):
                return at
    return target


# ---- scoring -------------------------------------------------------------------------------------


def score(answer: str, key: str) -> bool:
    """Correct iff the first run of digits in ``answer`` is exactly ``key``."""
    found = re.search(r"\d+", answer)
    return found is not None and found.group() == key


class _FirstNumber(StoppingCriteria):
    """Stops generation once the answer's first run of digits is complete (a non-digit follows it)."""

    def __init__(self, tokenizer: Any, start: int):
        self.tokenizer, self.start = tokenizer, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> bool:
        return re.search(r"\d[^\d]", self.tokenizer.decode(input_ids[0, self.start:])) is not None


@torch.no_grad()
def greedy_answer(model: nn.Module, tokenizer: Any, input_ids: torch.Tensor,
                  max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """Greedy continuation of ``input_ids [L]`` (``generate``, KV cache), stopped after the first run of digits or
    at EOS (which is not part of the answer)."""
    return _generate(model, tokenizer, input_ids, max_new_tokens)[0]


@torch.no_grad()
def answer_key(model: nn.Module, tokenizer: Any, input_ids: torch.Tensor, key: str,
               max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[str, list[float]]:
    """:func:`greedy_answer` and the log-probability (nats) of each token of ``" " + key`` given the prompt and the
    tokens before it, from the same prefill: the first token scored by the prefill's last logits, the others by
    decode steps on its KV cache cropped back to the prompt (the path generation takes, so a Focus adapter's
    ``dense_decode`` applies as it does to the answer)."""
    answer, out = _generate(model, tokenizer, input_ids, max_new_tokens)
    target = tokenizer(" " + key, add_special_tokens=False).input_ids
    logprobs = [out.logits[0][0].float().log_softmax(-1)[target[0]].item()]
    # transformers up to 5.23 names the KV cache past_key_values, later versions cache
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = getattr(out, name)
    cache.crop(input_ids.shape[-1] - cache.get_seq_length())  # negative: drop the answer's tokens
    device = next(model.parameters()).device
    for prev, nxt in zip(target[:-1], target[1:], strict=True):
        step = model(torch.tensor([[prev]], device=device), use_cache=True, **{name: cache})
        logprobs.append(step.logits[0, -1].float().log_softmax(-1)[nxt].item())
    return answer, logprobs


def _generate(model: nn.Module, tokenizer: Any, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[str, Any]:
    """The answer's text and ``generate``'s output (raw logits of every step, the KV cache)."""
    ids = input_ids[None].to(next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         temperature=None, top_p=None, top_k=None, pad_token_id=tokenizer.eos_token_id,
                         stopping_criteria=[_FirstNumber(tokenizer, ids.shape[1])], return_dict_in_generate=True,
                         output_logits=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in new:
        new = new[:new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new), out


class PrefillMeter(RoutingMeter):
    """:class:`RoutingMeter` counting the prefill only (decode steps attend to a cache: not a square pattern)."""

    @torch.no_grad()
    def __call__(self, adapter: FocusAdapter, args: tuple, output: Any) -> None:
        if args[2].shape[2] == args[3].shape[2]:
            super().__call__(adapter, args, output)


# ---- the evaluation ------------------------------------------------------------------------------


def check_passkey_args(model: nn.Module, lengths: list[int] | tuple[int, ...], depths: list[int] | tuple[int, ...],
                       keys_per_cell: int, haystacks: list[str] | tuple[str, ...],
                       modes: list[str] | tuple[str, ...], phrasings: list[str] | tuple[str, ...] = tuple(PHRASINGS)
                       ) -> None:
    """Raise ``ValueError`` with the reason for any input :func:`passkey_eval` cannot run."""
    limit = max_context(model)
    for length in lengths:
        if not 64 <= length <= limit:
            raise ValueError(f"length {length}: must be between 64 and the model's context of {limit} tokens "
                             "(config.max_position_embeddings)")
    for depth in depths:
        if not 0 <= depth <= 100:
            raise ValueError(f"depth {depth} is outside 0-100 (% of the haystack)")
    if keys_per_cell < 1:
        raise ValueError(f"keys_per_cell {keys_per_cell}: must be >= 1")
    if not lengths or not depths or not haystacks or not modes or not phrasings:
        raise ValueError("lengths, depths, haystacks, modes and phrasings each need at least one value")
    for name, given, known in (("haystack", haystacks, HAYSTACKS), ("mode", modes, PASSKEY_MODES),
                               ("phrasing", phrasings, tuple(PHRASINGS))):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{name} {unknown} unknown: choose from {known}")
    if "window" in modes and "focus" not in modes:
        raise ValueError("window needs focus too (its window is set so that its density matches focus's)")


def passkey_eval(model: nn.Module, tokenizer: Any, adapter: FocusAdapter | None,
                 lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
                 depths: list[int] | tuple[int, ...] = DEFAULT_DEPTHS, keys_per_cell: int = 2,
                 haystacks: list[str] | tuple[str, ...] = HAYSTACKS,
                 modes: list[str] | tuple[str, ...] = PASSKEY_MODES,
                 phrasings: list[str] | tuple[str, ...] = tuple(PHRASINGS), *, seed: int = 0,
                 progress: bool = True, earlier: list[PasskeyResult] | tuple[PasskeyResult, ...] = (),
                 on_result: Callable[[list[PasskeyResult]], None] | None = None) -> list[PasskeyResult]:
    """Passkey retrieval of every (mode, haystack, phrasing, length, depth, key) (module docstring for the protocol).

    ``adapter`` (needed for ``focus`` and ``window``) must not be attached; it is attached for ``focus`` only.
    ``earlier``: results of a run of this same model, adapter configuration and dtype; a (mode, prompt) they hold
    with this seed's key is taken from them instead of run again (window-only is matched to reused focus results too).
    ``on_result``: called with the results so far after each prompt run (not taken from ``earlier``), e.g. to save
    them so that an interrupted run can be resumed.
    """
    check_passkey_args(model, lengths, depths, keys_per_cell, haystacks, modes, phrasings)
    if ("focus" in modes) and adapter is None:
        raise ValueError("mode focus needs an adapter")
    if has_focus(model):
        raise RuntimeError("A Focus adapter is attached to this model, so 'full' would not be the model's own "
                           "attention: detach it before passkey_eval() (which attaches the adapter itself).")
    modes = [m for m in PASSKEY_MODES if m in modes]
    cells = prompts_of(haystacks, lengths, depths, keys_per_cell, phrasings)
    prompts = {c: c.build(tokenizer, c.key(seed)) for c in cells}
    done = {(r.mode, r.prompt): r for r in earlier}
    results: list[PasskeyResult] = []
    was_training, old_mode = model.training, adapter.mode if adapter is not None else None
    model.eval()
    bar = tqdm(total=len(cells) * len(modes), desc="passkey", disable=not progress)
    try:
        for haystack in haystacks:
            for length in lengths:
                group = [c for c in cells if (c.haystack, c.length) == (haystack, length)]
                for mode in modes:  # focus before window: window-only's window matches focus's density
                    for cell in group:
                        bar.set_postfix_str(f"{mode} {haystack} {cell.phrasing} {length} {cell.depth}%")
                        old = done.get((mode, cell))
                        if old is not None and old.key == prompts[cell].key:
                            results.append(old)
                        else:
                            _run(model, tokenizer, adapter, mode, cell, prompts[cell], results)
                            if on_result is not None:
                                on_result(results)
                        bar.update()
    finally:
        bar.close()
        model.train(was_training)
        if adapter is not None:
            adapter.mode = old_mode
    return results


def _run(model: nn.Module, tokenizer: Any, adapter: FocusAdapter | None, mode: str,
         cell: Prompt, prompt: PasskeyPrompt, results: list[PasskeyResult]) -> None:
    """One prompt in one mode, appended to ``results`` (window-only's window matches the focus results of its haystack,
    length and phrasing)."""
    haystack, length, depth, number, phrasing = cell
    t0 = time.perf_counter()
    if mode == "full":
        (answer, logprobs), density = answer_key(model, tokenizer, prompt.input_ids, prompt.key), 1.0
    elif mode == "focus":
        assert adapter is not None
        adapter.mode = "fast"
        adapter.attach(model)
        meter = PrefillMeter(adapter)
        try:
            answer, logprobs = answer_key(model, tokenizer, prompt.input_ids, prompt.key)
        finally:
            meter.remove()
            adapter.detach(model)
        density, _ = meter.means()
    else:
        assert adapter is not None
        cfg = adapter.config
        focus = [r.density for r in results
                 if r.mode == "focus" and (r.haystack, r.length, r.phrasing) == (haystack, length, phrasing)]
        tail = cfg.tail(length)
        w = matching_window(length, cfg.sink_tokens, sum(focus) / len(focus), tail)
        with window_only(model, w, cfg.sink_tokens, cfg.layers, dense_decode=cfg.dense_decode,
                         dense_tail=cfg.dense_tail):
            answer, logprobs = answer_key(model, tokenizer, prompt.input_ids, prompt.key)
        density = window_density(length, w, cfg.sink_tokens, tail)
    results.append(PasskeyResult(mode, haystack, length, depth, number, prompt.key, answer,
                                 score(answer, prompt.key), prompt.depth, density, time.perf_counter() - t0,
                                 sum(logprobs), logprobs[0], phrasing))


# ---- analysis: which heads read the key, and what Focus keeps of them ------------------------------


@dataclass
class KeyAttention:
    """Attention of the answer's queries onto the key, per Focus layer and query head (``[layers, Hq]`` tensors).

    The queries are the positions that predict the answer's tokens (the prompt's last token, then the key's own
    tokens, teacher-forced); "key tokens" are the digits of both copies of the key in the needle.
    """

    layers: list[int]
    mass: torch.Tensor  # full attention's probability mass on the key tokens, mean over the answer's queries
    kept: torch.Tensor  # the part of ``mass`` on pairs the hard Focus pattern computes (window, sinks, shared group)
    kept_all: torch.Tensor  # the part of all of full attention's mass that the hard pattern computes
    shared: torch.Tensor  # fraction of (answer query, key token) pairs whose groups intersect
    query_groups: torch.Tensor  # [layers, Hq, answer queries, query_top_k] groups of the answer's queries
    key_groups: torch.Tensor  # [layers, Hkv, key tokens, key_top_k] groups of the key tokens
    # (top-k: the largest of the layers' (``FocusConfig.at``); -1 after a layer's own groups)


@torch.no_grad()
def key_attention(model: nn.Module, tokenizer: Any, prompt: PasskeyPrompt, adapter: FocusAdapter) -> KeyAttention:
    """Where full attention reads the key from, and how much of it the adapter's hard pattern keeps.

    One forward with the model's own attention over the prompt plus the key's answer tokens (teacher-forced);
    routing is applied to that forward's post-RoPE q/k, so every layer is judged on the vectors full attention
    computes (its input is not yet changed by Focus in the layers below).
    """
    from focus_flex import routing
    from focus_flex.train import centerings, routing_vectors, teacher_qkv

    answer = tokenizer(" " + prompt.key, add_special_tokens=False)["input_ids"]
    ids = torch.cat([prompt.input_ids, torch.tensor(answer[:-1])])
    n, queries = len(ids), torch.arange(len(prompt.input_ids) - 1, len(ids))
    keys = torch.tensor([i for i in range(*prompt.needle) if tokenizer.decode(ids[i:i + 1]).strip().isdigit()])
    qkv = teacher_qkv(model, ids[None])
    cfg, centering = adapter.config, centerings(adapter, model)
    out: dict[str, list[torch.Tensor]] = {f: [] for f in ("mass", "kept", "kept_all", "shared", "qg", "kg")}
    i, j = queries[:, None], torch.arange(n)[None, :]
    local = (j <= i) & ((i - j < cfg.window) | (j < cfg.sink_tokens))  # [Q, N]
    for layer in cfg.layers:
        q, k, scale = qkv[layer].q[0].float(), qkv[layer].k[0].float(), qkv[layer].scale
        rep = q.shape[0] // k.shape[0]
        probs = (q[:, queries] @ k.repeat_interleave(rep, 0).transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
        probs = probs.masked_fill(j > i, float("-inf")).softmax(-1)  # [Hq, Q, N]
        c = adapter.centroids[adapter.slot[layer]].detach().float()
        q_route = routing_vectors(q[None, :, queries], centering[adapter.slot[layer]], "query", queries)
        k_route = routing_vectors(k[None], centering[adapter.slot[layer]], "key")
        own = cfg.at(layer)  # the layer's own top-k
        top_q, top_k = own.query_top_k, own.key_top_k
        qm = routing.hard_membership(q_route, c, top_q)[0]  # [Hq, Q]
        km = routing.hard_membership(k_route, c, top_k)[0].repeat_interleave(rep, 0)  # [Hq, N]
        share = (qm[:, :, None] & km[:, None, :]) != 0
        allowed = local | (share & (j <= i))
        mass = probs[..., keys].sum(-1)  # [Hq, Q]
        out["mass"].append(mass.mean(-1))
        out["kept"].append((probs * allowed)[..., keys].sum(-1).mean(-1) / mass.mean(-1).clamp_min(1e-30))
        out["kept_all"].append((probs * allowed).sum(-1).mean(-1))
        out["shared"].append(share[..., keys].float().mean((-1, -2)))
        out["qg"].append(routing.hard_groups(q_route, c, top_q)[0])
        out["kg"].append(routing.hard_groups(k_route[:, :, keys], c, top_k)[0])
    for f in ("qg", "kg"):  # layers with fewer groups per vector: padded with -1
        width = max(g.shape[-1] for g in out[f])
        out[f] = [torch.nn.functional.pad(g, (0, width - g.shape[-1]), value=-1) for g in out[f]]
    stack = {f: torch.stack(v) for f, v in out.items()}
    return KeyAttention(list(cfg.layers), stack["mass"], stack["kept"], stack["kept_all"], stack["shared"],
                        stack["qg"], stack["kg"])


# ---- reporting -----------------------------------------------------------------------------------


def _tally(results: list[PasskeyResult]) -> str:
    return f"{sum(r.correct for r in results)}/{len(results)}"


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a success rate (95% for ``z`` 1.96): the rates ``p`` whose distance from the
    observed share is at most ``z`` standard errors ``sqrt(p (1 - p) / trials)``."""
    if trials <= 0:
        raise ValueError(f"wilson_interval needs at least one trial, got {trials}")
    share, z2 = successes / trials, z * z / trials
    center = (share + z2 / 2) / (1 + z2)
    half = z * math.sqrt(share * (1 - share) / trials + z2 / (4 * trials)) / (1 + z2)
    return max(0.0, center - half), min(1.0, center + half)


def _share(results: list[PasskeyResult]) -> str:
    """correct/total with the share and its Wilson 95% interval ("7/11: 64% [35-85%]"); "0/0" for none."""
    if not results:
        return "0/0"
    correct = sum(r.correct for r in results)
    low, high = wilson_interval(correct, len(results))
    return f"{correct}/{len(results)}: {100 * correct / len(results):.0f}% [{100 * low:.0f}-{100 * high:.0f}%]"


def _mean_logprob(results: list[PasskeyResult]) -> str:
    """Mean key log-probability of ``results``: "all tokens (first token; the rest)"."""
    rows = [r for r in results if r.key_logprob is not None and r.first_logprob is not None]
    if not rows:
        return "-"
    total, first = (sum(getattr(r, f) for r in rows) / len(rows) for f in ("key_logprob", "first_logprob"))
    return f"{total:.2f} ({first:.2f}; {total - first:.2f})"


def paired(results: list[PasskeyResult], mode: str) -> list[tuple[PasskeyResult, PasskeyResult]]:
    """``mode``'s results with full attention's on the same prompt and key (the same seed's), as (mode's, full's)."""
    full = {(r.prompt, r.key): r for r in results if r.mode == "full"}
    return [(r, full[r.prompt, r.key]) for r in results if r.mode == mode and (r.prompt, r.key) in full]


def retained(results: list[PasskeyResult], mode: str) -> list[PasskeyResult]:
    """``mode``'s results on the prompts that full attention answers correctly (the retrieval Focus must keep)."""
    return [r for r, full in paired(results, mode) if full.correct]


def _against_full(pairs: list[tuple[PasskeyResult, PasskeyResult]]) -> str:
    """One cell of the paired comparison: the mean difference of the key's log-probability (mode's minus full
    attention's) ± its standard error over the prompts, then keys lost / gained ("-4/+1")."""
    lost = sum(f.correct and not r.correct for r, f in pairs)
    gained = sum(r.correct and not f.correct for r, f in pairs)
    diff = [r.key_logprob - f.key_logprob for r, f in pairs if r.key_logprob is not None and f.key_logprob is not None]
    if not diff:
        mean = "-"
    else:
        mean = f"{statistics.fmean(diff):+.2f}"
        if len(diff) > 1:
            mean += f" ± {statistics.stdev(diff) / math.sqrt(len(diff)):.2f}"
    return f"{mean}, -{lost}/+{gained}"


def load_passkey(path: str | os.PathLike) -> list[PasskeyResult]:
    """The results of a ``passkey.json`` written by :func:`save_passkey`."""
    with open(path, encoding="utf-8") as f:
        return [PasskeyResult(**r) for r in json.load(f)["results"]]


def _sections(results: list[PasskeyResult]) -> list[tuple[str, str]]:
    """The (haystack, phrasing) pairs of ``results``, in order of appearance: one table or heatmap panel each."""
    return list(dict.fromkeys((r.haystack, r.phrasing) for r in results))


def passkey_markdown(results: list[PasskeyResult], protocol: str = "") -> str:
    """Markdown tables for each haystack and phrasing: correct/total per mode and length, the key's mean
    log-probability, then correct/total per depth; with full attention's results, each other mode's share of the
    keys full attention retrieves (with its :func:`wilson_interval`) and its comparison with full attention prompt by
    prompt (:func:`paired`)."""
    modes = list(dict.fromkeys(r.mode for r in results))
    lines = []
    for haystack, phrasing in _sections(results):
        rows = [r for r in results if (r.haystack, r.phrasing) == (haystack, phrasing)]
        lengths = sorted({r.length for r in rows})
        depths = sorted({r.depth for r in rows})
        lines += [f"**Haystack `{haystack}`, phrasing `{phrasing}`**: keys retrieved (correct/total) and density "
                  "(% of causal pairs)", "",
                  "| mode | " + " | ".join(f"{n} tokens" for n in lengths) + " | all | density |",
                  "|---" * (len(lengths) + 3) + "|"]
        for mode in modes:
            cells = [[r for r in rows if r.mode == mode and r.length == n] for n in lengths]
            mine = [r for r in rows if r.mode == mode]
            dens = ", ".join(f"{100 * sum(r.density for r in c) / len(c):.1f}%" for c in cells if c)
            lines.append(f"| {mode} | " + " | ".join(_tally(c) for c in cells) + f" | {_tally(mine)} | {dens} |")
        if any(r.first_logprob is not None for r in rows):
            lines += ["", "Mean log-probability of the key (nats; its tokens teacher-forced on the answer's path; 0: "
                      "certain, higher is better): all its tokens (the first token, which starts the answer with "
                      "the number; the rest, the key given that start); \"-\": not measured", "",
                      "| mode | " + " | ".join(f"{n} tokens" for n in lengths) + " | all |",
                      "|---" * (len(lengths) + 2) + "|"]
            for mode in modes:
                cells = [[r for r in rows if r.mode == mode and r.length == n] for n in lengths]
                lines.append(f"| {mode} | " + " | ".join(_mean_logprob(c) for c in cells)
                             + f" | {_mean_logprob(sum(cells, []))} |")
        lines += ["", "| mode \\ depth | " + " | ".join(f"{d}%" for d in depths) + " |", "|---" * (len(depths) + 1)
                  + "|"]
        for mode in modes:
            lines.append(f"| {mode} | " + " | ".join(_tally([r for r in rows if r.mode == mode and r.depth == d])
                                                    for d in depths) + " |")
        others = [m for m in modes if m != "full"]
        if "full" in modes and others:
            lines += ["", "Of the keys full attention retrieves, retrieved by each mode (the share with its Wilson "
                      "95% interval: what the sample says of the share on more keys like these):", "",
                      "| mode | " + " | ".join(f"{n} tokens" for n in lengths) + " | all |",
                      "|---" * (len(lengths) + 2) + "|"]
            for mode in others:
                kept = retained(rows, mode)
                lines.append(f"| {mode} | " + " | ".join(_share([r for r in kept if r.length == n]) for n in lengths)
                             + f" | {_share(kept)} |")
            measured = ("the key's log-probability, mode's minus full attention's (nats, mean ± standard error over "
                        "the prompts; near ties show here before they flip a key), and "
                        if any(r.key_logprob is not None for r in rows) else "")
            lines += ["", f"Against full attention on the same prompts: {measured}keys lost (full attention retrieves "
                      "them, the mode does not) / gained:", "",
                      "| mode | " + " | ".join(f"{n} tokens" for n in lengths) + " | all |",
                      "|---" * (len(lengths) + 2) + "|"]
            for mode in others:
                pairs = paired(rows, mode)
                lines.append(f"| {mode} | " + " | ".join(_against_full([(r, f) for r, f in pairs if r.length == n])
                                                        for n in lengths) + f" | {_against_full(pairs)} |")
        lines.append("")
    return "\n".join(lines) + ("\n" + protocol.strip() + "\n" if protocol else "")


def plot_passkey(results: list[PasskeyResult], mode: str, path: str) -> str:
    """PNG heatmap of one mode: fraction of keys retrieved per depth (rows) and length (columns), one panel per
    haystack and phrasing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = _sections(results)
    fig, axes = plt.subplots(1, len(sections), figsize=(3.2 * len(sections) + 1, 3.4), dpi=120, squeeze=False,
                             layout="constrained")
    for ax, (haystack, phrasing) in zip(axes[0], sections, strict=True):
        rows = [r for r in results if r.mode == mode and (r.haystack, r.phrasing) == (haystack, phrasing)]
        lengths, depths = sorted({r.length for r in rows}), sorted({r.depth for r in rows})
        grid = torch.full((len(depths), len(lengths)), float("nan"))
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                cell = [r for r in rows if r.depth == d and r.length == n]
                if cell:
                    grid[i, j] = sum(r.correct for r in cell) / len(cell)
                    ax.text(j, i, _tally(cell), ha="center", va="center", fontsize=8)
        image = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{mode}, {haystack}, {phrasing}", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.05, label="keys retrieved")
    fig.savefig(path)
    plt.close(fig)
    return path


def save_passkey(directory: str, results: list[PasskeyResult], meta: dict[str, Any], protocol: str) -> dict[str, str]:
    """Write ``passkey.json``, ``passkey.md`` and one ``passkey_{mode}.png`` per mode; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = {PASSKEY_JSON: os.path.join(directory, PASSKEY_JSON), PASSKEY_MD: os.path.join(directory, PASSKEY_MD)}
    write_passkey_json(paths[PASSKEY_JSON], results, meta, protocol)
    with open(paths[PASSKEY_MD], "w") as f:
        f.write(passkey_markdown(results, protocol))
    for mode in dict.fromkeys(r.mode for r in results):
        name = f"passkey_{mode}.png"
        paths[name] = plot_passkey(results, mode, os.path.join(directory, name))
    return paths


def write_passkey_json(path: str, results: list[PasskeyResult], meta: dict[str, Any], protocol: str) -> None:
    """Write ``results`` with ``meta`` and ``protocol`` as a ``passkey.json`` at ``path``, atomically: a run killed
    while writing leaves the previous file whole."""
    with open(path + ".tmp", "w") as f:
        json.dump({**meta, "protocol": protocol, "results": [asdict(r) for r in results]}, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def passkey_protocol(dtype: str, dense_decode: bool = False, dense_tail: int = 0,
                     dense_heads: list[list[int]] | None = None,
                     phrasings: list[str] | tuple[str, ...] = tuple(PHRASINGS),
                     layer_top_k: list[list[int]] | None = None) -> str:
    """One paragraph describing the protocol, for the reports (``dense_decode``, ``dense_tail``, ``dense_heads``,
    ``layer_top_k``: the adapter's; ``phrasings``: those evaluated)."""
    decode = (" Generation steps attend every token in both (`dense_decode`); the density counts the prefill."
              if dense_decode else "")
    if dense_tail:
        decode += (f" The last {dense_tail} tokens of the prompt attend every token in both (`dense_tail`), counted in "
                   "the density.")
    if dense_heads:
        decode += (" In focus, the query heads of KV heads " + ", ".join(f"{a}.{b}" for a, b in dense_heads)
                   + " (layer.KV head) attend every token (`dense_heads`), counted in the density; window-only has "
                   "none, its window matches the total.")
    if layer_top_k:
        decode += (" In focus, layers " + ", ".join(f"{a} ({q}, {k})" for a, q, k in layer_top_k) + " route each "
                   "query and key into their own number of groups (query, key; `layer_top_k`), counted in the density.")
    words = "; ".join(f"`{name}`: needle \"{text.needle.format(key='NNNNN').strip()}\", answer started as "
                      f"{json.dumps(text.answer_prefix)}" for name, text in PHRASINGS.items() if name in phrasings)
    return ("Passkey retrieval: a 5-digit key in a needle at the given depth of the haystack (`filler`: \"" + FILLER
            + "\" repeated; `prose`: excerpts of the shipped held-out books), asked for at the end, the whole prompt "
            "in the model's chat template with the answer started; phrasings (" + words + "); correct iff greedy "
            "decoding's first number is the key; " + dtype + ". Window-only: "
            "window + sinks at focus's density measured on the same prompts." + decode)
