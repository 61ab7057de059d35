"""Tests of focus_flex.passkey: prompts, scoring, the three modes on the real SmolLM2, and ``eval --task passkey``."""

from __future__ import annotations

import json
import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from focus_flex import FocusAdapter
from focus_flex import passkey as P
from focus_flex.adapter import has_focus
from focus_flex.cli import main
from focus_flex.evaluate import matching_window, window_density, window_only

ADAPTER = str(Path(__file__).resolve().parents[1] / "hub" / "smollm2-135m-instruct-focus")
# A passkey.json written before phrasings and the key's log-probability existed (the retrieval adapter's card of
# 2026-11-25, cut to its 1K, 10%-depth, first-key prompts): older runs must still load and resume.
OLDER_RUN = Path(__file__).resolve().parent / "data" / "passkey_before_phrasings.json"


def test_score_takes_the_first_number_exactly():
    assert P.score(" 71432.", "71432")
    assert P.score(" 7 1 4 3 2", "71432") is False  # digits must form one number
    assert not P.score(" 71433.", "71432")
    assert not P.score(" 714321", "71432")  # a longer number is not the key
    assert not P.score(" 1. 71432", "71432")  # only the first number counts
    assert not P.score(" unknown", "71432")


def test_keys_are_five_digits_fixed_per_cell_and_distinct_across_cells():
    keys = {P.make_key(h, n, d, k) for h in P.HAYSTACKS for n in (2048, 4096) for d in (10, 50) for k in range(2)}
    assert len(keys) == 16 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert P.make_key("filler", 2048, 10, 0) == P.make_key("filler", 2048, 10, 0)
    assert P.make_key("filler", 2048, 10, 0, seed=1) != P.make_key("filler", 2048, 10, 0)


def test_bad_arguments_raise_clear_errors():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512))
    ok = dict(lengths=[256], depths=[50], keys_per_cell=1, haystacks=["filler"], modes=["full"])
    P.check_passkey_args(model, **ok)
    for change, match in [({"lengths": [1024]}, "context of 512"), ({"depths": [101]}, "outside 0-100"),
                          ({"depths": [-5]}, "outside 0-100"), ({"keys_per_cell": 0}, ">= 1"),
                          ({"haystacks": ["lorem"]}, "unknown"), ({"modes": ["soft"]}, "unknown"),
                          ({"modes": ["full", "window"]}, "needs focus"), ({"depths": []}, "at least one"),
                          ({"phrasings": ["haiku"]}, "phrasing \\['haiku'\\] unknown"),
                          ({"phrasings": []}, "at least one")]:
        with pytest.raises(ValueError, match=match):
            P.check_passkey_args(model, **{**ok, **change})
    with pytest.raises(ValueError, match="needs an adapter"):
        P.passkey_eval(model, None, None, [256], [50], 1, ["filler"], ["full", "focus"])


@pytest.mark.slow
@pytest.mark.parametrize("haystack", P.HAYSTACKS)
def test_prompt_has_the_length_and_puts_the_key_at_the_depth(smollm2, haystack):
    _, tok = smollm2
    for length, depth in [(512, 0), (1024, 10), (2048, 50), (2048, 90), (1024, 100)]:
        p = P.build_prompt(tok, length, depth, "71432", haystack, number=3)
        assert p.input_ids.shape == (length,)
        assert tok.decode(p.input_ids[p.key_tokens]).strip() == "71432"
        assert tok.decode(p.input_ids[p.needle[0]:p.needle[1]]) == P.NEEDLE.format(key="71432")
        text = tok.decode(p.input_ids)
        assert text.count("71432") == 2 and text.endswith("What is the pass key?<|im_end|>\n<|im_start|>assistant\n"
                                                            "The pass key is")
        hay = length - (p.needle[1] - p.needle[0]) - (len(tok.encode(text.split("\n\n", 1)[0] + "\n\n")))
        assert abs(p.depth - depth) <= 100 * 64 / hay  # within the sentence-boundary search
        if haystack == "filler":  # a filler sentence is ~5 tokens: the needle is within one sentence of the depth
            assert abs(p.depth - depth) <= 100 * 6 / hay
    other = P.build_prompt(tok, 1024, 50, "71432", haystack, number=4)
    assert (haystack == "prose") == (not torch.equal(other.input_ids, P.build_prompt(tok, 1024, 50, "71432", haystack,
                                                                                     number=3).input_ids))


def test_prompt_takes_other_words_around_the_same_haystack(smollm2):
    """``build_prompt(text=PromptText(...))``: another instruction, needle, question and started answer around the
    same haystack excerpt, still exactly ``length`` tokens with the key where the needle says; a needle without
    ``{key}`` is refused."""
    _, tok = smollm2
    text = P.PromptText(instruction="Read this.\n\n", needle=" (The code is {key}.)", question="\n\nThe code?",
                        answer_prefix="The code is")
    p = P.build_prompt(tok, 700, 40, "2-9-1-4", "prose", number=2, text=text)
    base = P.build_prompt(tok, 700, 40, "71432", "prose", number=2)
    assert p.input_ids.shape == (700,)
    assert tok.decode(p.input_ids[p.key_tokens]).strip() == "2-9-1-4"
    assert tok.decode(p.input_ids[p.needle[0]:p.needle[1]]) == " (The code is 2-9-1-4.)"
    decoded = tok.decode(p.input_ids)
    assert "user\nRead this.\n\n" in decoded and decoded.endswith("The code?<|im_end|>\n<|im_start|>assistant\n"
                                                                     "The code is")
    hay = tok.decode(base.input_ids[base.needle[1]:base.needle[1] + 40])  # the passkey's haystack goes on after it
    assert hay in decoded and "pass key" not in decoded
    with pytest.raises(ValueError, match="no '{key}'"):
        P.build_prompt(tok, 700, 40, "71432", "prose", text=P.PromptText(needle=" The code is secret."))


@pytest.mark.parametrize("haystack", P.HAYSTACKS)
def test_phrasings_hide_the_same_key_in_the_same_haystack(smollm2, haystack):
    """RULER's phrasing: its own instruction, needle, question and started answer around the passkey's haystack,
    with the same key at the same depth."""
    _, tok = smollm2
    passkey, ruler = (P.build_prompt(tok, 1024, 30, "71432", haystack, 1, P.PHRASINGS[p]) for p in ("passkey", "ruler"))
    assert ruler.input_ids.shape == (1024,) and tok.decode(ruler.input_ids[ruler.key_tokens]).strip() == "71432"
    assert tok.decode(ruler.input_ids[ruler.needle[0]:ruler.needle[1]]) == (
        " One of the special magic numbers for quiet-harbor is: 71432.")
    text = tok.decode(ruler.input_ids)
    assert "user\nSome special magic numbers are hidden within the following text." in text and "pass key" not in text
    assert text.endswith("mentioned in the provided text?<|im_end|>\n<|im_start|>assistant\nThe special magic numbers "
                         "for quiet-harbor mentioned in the provided text is:\n\n-")
    after = tok.decode(passkey.input_ids[passkey.needle[1]:passkey.needle[1] + 30])  # the haystack after the needle
    assert after in text and abs(ruler.depth - passkey.depth) < 1
    # a result (as the benchmarks load them from passkey.json) rebuilds the prompt it answered, in its phrasing
    for phrasing, built in (("passkey", passkey), ("ruler", ruler)):
        r = P.PasskeyResult("full", haystack, 1024, 30, 1, "71432", "", False, 0.0, 1.0, 0.0, phrasing=phrasing)
        assert r.prompt == P.Prompt(haystack, 1024, 30, 1, phrasing)
        assert torch.equal(r.prompt.build(tok, r.key).input_ids, built.input_ids)


@pytest.mark.slow
def test_full_attention_retrieves_and_a_blind_window_does_not(smollm2):
    """Real SmolLM2 at 512 tokens: full attention reads the key back; a window that cannot see the needle fails."""
    model, tok = smollm2
    p = P.build_prompt(tok, 512, 20, "58213", "filler")
    answer = P.greedy_answer(model, tok, p.input_ids)
    assert P.score(answer, "58213"), answer
    with window_only(model, 32, 4):  # the needle ends ~380 tokens before the question
        blind = P.greedy_answer(model, tok, p.input_ids)
    assert not P.score(blind, "58213"), blind
    assert P.greedy_answer(model, tok, p.input_ids) == answer  # the model's own attention is back


def test_greedy_answer_stops_after_the_first_number_without_deprecation_warnings(smollm2, recwarn):
    """Decoding goes through ``generate`` (no deprecated cache arguments) and stops once the number is complete."""
    model, tok = smollm2
    p = P.build_prompt(tok, 256, 30, "58213", "filler")
    answer = P.greedy_answer(model, tok, p.input_ids)
    assert P.score(answer, "58213") and answer.rstrip().endswith(("58213.", "58213 .")), answer
    short = P.greedy_answer(model, tok, p.input_ids, max_new_tokens=2)
    assert answer.startswith(short) and 0 < len(tok.encode(short)) <= 2, short
    assert not [w for w in recwarn if issubclass(w.category, (FutureWarning, DeprecationWarning))], \
        [str(w.message) for w in recwarn]


def teacher_forced_logprob(model, tok, input_ids, key):
    """log p(" " + key | prompt) from one forward over the prompt and the key (no KV cache)."""
    target = tok(" " + key, add_special_tokens=False).input_ids
    ids = torch.cat([input_ids, torch.tensor(target[:-1])])[None]
    with torch.no_grad():
        logp = model(ids).logits[0, -len(target):].float().log_softmax(-1)
    return float(logp[torch.arange(len(target)), torch.tensor(target)].sum())


@pytest.mark.slow
def test_answer_key_scores_the_key_on_the_answers_path(smollm2, caplog):
    """The key's log-probability from the answer's own prefill and cache equals a teacher-forced forward without a
    cache: with the model's own attention and with a Focus adapter (its decode steps see what its prefill rows see)."""
    model, tok = smollm2
    p = P.build_prompt(tok, 512, 20, "58213", "filler")
    answer, logprobs = P.answer_key(model, tok, p.input_ids, "58213")
    assert answer == P.greedy_answer(model, tok, p.input_ids)
    assert len(logprobs) == len(tok(" 58213", add_special_tokens=False).input_ids)
    logprob = sum(logprobs)
    assert logprob == pytest.approx(teacher_forced_logprob(model, tok, p.input_ids, "58213"), abs=1e-3)
    assert -5 < logprob < 0  # full attention retrieves this key (the test above)
    assert sum(P.answer_key(model, tok, p.input_ids, "58214")[1]) < logprob - 1  # another key is much less likely
    adapter = FocusAdapter.from_pretrained(ADAPTER)
    adapter.config.dense_tail, adapter.config.dense_decode = 0, False
    adapter.attach(model)
    try:
        answer, focus = P.answer_key(model, tok, p.input_ids, "58213")
        focus = sum(focus)
        assert answer == P.greedy_answer(model, tok, p.input_ids)
        assert focus == pytest.approx(teacher_forced_logprob(model, tok, p.input_ids, "58213"), abs=1e-3)
    finally:
        adapter.detach(model)
    assert abs(focus - logprob) > 1e-3  # the pattern (window 256, needle ~380 back) changed the answer's odds
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text


@pytest.mark.slow
def test_eval_task_passkey_writes_table_json_and_heatmaps(tmp_path, capsys):
    out = tmp_path / "pk"
    assert main(["eval", ADAPTER, "--task", "passkey", "--lengths", "384", "--depths", "30", "--keys-per-cell", "1",
                 "--output-dir", str(out), "--no-progress"]) == 0
    data = json.loads((out / P.PASSKEY_JSON).read_text())
    rows = data["results"]
    assert {(r["mode"], r["haystack"], r["phrasing"]) for r in rows} == {
        (m, h, p) for m in P.PASSKEY_MODES for h in P.HAYSTACKS for p in P.PHRASINGS}
    assert {r["length"] for r in rows} == {384} and all(len(r["key"]) == 5 for r in rows)
    assert all(r["correct"] == P.score(r["answer"], r["key"]) for r in rows)
    full = [r for r in rows if r["mode"] == "full"]
    assert all(r["correct"] for r in full), full  # 384 tokens: the model's own attention retrieves
    focus = {r["haystack"]: r["density"] for r in rows if r["mode"] == "focus"}
    window = {r["haystack"]: r["density"] for r in rows if r["mode"] == "window"}
    for h in P.HAYSTACKS:
        assert 0 < focus[h] < 1 and window[h] >= focus[h]  # the window is matched to focus's measured density
    table = (out / P.PASSKEY_MD).read_text()
    assert table.count("| full | 1/1 | 1/1 |") == 4 and "Haystack `prose`, phrasing `ruler`" in table
    assert all(r["key_logprob"] < r["first_logprob"] < 0 for r in rows) and "Mean log-probability of the key" in table
    for h in P.HAYSTACKS:  # the key is likelier where it was retrieved than where the window could not see it
        for p in P.PHRASINGS:
            lp = {r["mode"]: r["key_logprob"] for r in rows if (r["haystack"], r["phrasing"]) == (h, p)}
            assert lp["full"] > lp["window"], (h, p, lp)
    for mode in P.PASSKEY_MODES:
        assert (out / f"passkey_{mode}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["focus_config"]["num_groups"] == FocusAdapter.from_pretrained(ADAPTER).config.num_groups
    assert "passkey_markdown" not in data["focus_config"]["extra"]  # the card's earlier table is not this run's
    # the evaluated copy of the adapter: its card holds the retrieval table and heatmaps next to the perplexity table
    copy = FocusAdapter.from_pretrained(str(out))
    assert torch.equal(copy.centroids, FocusAdapter.from_pretrained(ADAPTER).centroids)
    card = (out / "README.md").read_text()
    assert card.index("| focus |") < card.index("## Long-range retrieval (passkey)") < card.index(table.split("\n")[0])
    assert "(passkey_full.png)" in card and "--task passkey" in card
    # full attention's results reused from that run: the same rows, not run again; other seeds' prompts are refused;
    # with --dense-decode and --dense-tail the saved copy and the report say so
    again = tmp_path / "pk2"
    argv = ["eval", ADAPTER, "--task", "passkey", "--lengths", "384", "--depths", "30", "--keys-per-cell", "1",
            "--modes", "full", "focus", "--phrasings", "ruler", "--full-results", str(out / P.PASSKEY_JSON),
            "--no-progress"]
    assert main([*argv, "--dense-decode", "--dense-tail", "20", "--output-dir", str(again)]) == 0
    rows2 = json.loads((again / P.PASSKEY_JSON).read_text())["results"]
    assert [r for r in rows2 if r["mode"] == "full"] == [r for r in full if r["phrasing"] == "ruler"]
    assert {r["phrasing"] for r in rows2} == {"ruler"}
    assert "Of the keys full attention retrieves" in (again / P.PASSKEY_MD).read_text()
    assert "Generation steps attend every token" in (again / P.PASSKEY_MD).read_text()
    assert "The last 20 tokens of the prompt attend every token" in (again / P.PASSKEY_MD).read_text()
    assert FocusAdapter.from_pretrained(str(again)).config.dense_decode
    assert FocusAdapter.from_pretrained(str(again)).config.dense_tail == 20
    # with --modes focus alone the reused rows still join the report: Focus is compared with full attention
    focus_only = [*argv[:argv.index("--modes")], "--modes", "focus", *argv[argv.index("--phrasings"):]]
    assert main([*focus_only, "--output-dir", str(tmp_path / "pk6")]) == 0
    rows6 = json.loads((tmp_path / "pk6" / P.PASSKEY_JSON).read_text())["results"]
    assert [r for r in rows6 if r["mode"] == "full"] == [r for r in full if r["phrasing"] == "ruler"]
    assert "Against full attention on the same prompts" in (tmp_path / "pk6" / P.PASSKEY_MD).read_text()
    assert main([*argv, "--seed", "1", "--output-dir", str(tmp_path / "pk3")]) == 2
    err = capsys.readouterr().err
    assert "no full-attention result for 2 of the 2 prompts" in err and "(--phrasings passkey ruler)" in err
    # several files, each holding some of the prompts (one phrasing each), together answer a run of both phrasings
    parts = []
    for phrasing in P.PHRASINGS:
        parts.append(tmp_path / f"full-{phrasing}.json")
        parts[-1].write_text(json.dumps({**data, "results": [r for r in full if r["phrasing"] == phrasing]}))
    both = tmp_path / "pk4"
    both_phrasings = [*argv[:argv.index("--phrasings")], "--no-progress", "--full-results"]
    assert main([*both_phrasings, *map(str, parts), "--output-dir", str(both)]) == 0
    reused = [r for r in json.loads((both / P.PASSKEY_JSON).read_text())["results"] if r["mode"] == "full"]
    assert sorted(reused, key=json.dumps) == sorted(full, key=json.dumps)
    assert main([*both_phrasings, str(parts[0]), "--output-dir", str(tmp_path / "pk5")]) == 2
    assert "no full-attention result for 2 of the 4 prompts" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_task_passkey_resumes_runs_of_the_same_configuration_only(tmp_path, capsys):
    """``--resume``: the prompts and modes an earlier run of this configuration holds are taken from it (the same
    records, timings included), the others run; window-only is matched to the reused focus results; a run of another
    configuration, dtype or model is refused, naming the difference."""
    argv = ["eval", ADAPTER, "--task", "passkey", "--lengths", "384", "--keys-per-cell", "1", "--haystacks", "prose",
            "--phrasings", "ruler", "--no-progress"]
    first = tmp_path / "first"
    assert main([*argv, "--depths", "30", "--modes", "full", "focus", "--output-dir", str(first)]) == 0
    old = json.loads((first / P.PASSKEY_JSON).read_text())["results"]
    both = tmp_path / "both"
    assert main([*argv, "--depths", "30", "70", "--resume", str(first / P.PASSKEY_JSON),
                 "--output-dir", str(both)]) == 0
    assert f"--resume: 2 of 6 results taken from {first / P.PASSKEY_JSON}, 4 run" in capsys.readouterr().out
    rows = json.loads((both / P.PASSKEY_JSON).read_text())["results"]
    assert [r for r in rows if r["depth"] == 30 and r["mode"] != "window"] == old  # taken, not run again
    assert "--resume" in json.loads((both / P.PASSKEY_JSON).read_text())["command"]
    assert "--resume" not in (both / "README.md").read_text()  # the card's command runs without the earlier files
    assert "--depths 30 70 --output-dir" in (both / "README.md").read_text()
    # how the adapter was made: its training, then the perplexity evaluation whose table (and settings) it carries
    extra = FocusAdapter.from_pretrained(ADAPTER).config.extra
    made = (both / "README.md").read_text().split("## How it was made")[1]
    assert made.index(extra["trained_with"].splitlines()[0]) < made.index(extra["command"])
    fresh = {r["mode"]: r for r in rows if r["depth"] == 70}
    assert set(fresh) == {"full", "focus", "window"} and fresh["full"]["density"] == 1.0
    assert 0 < fresh["focus"]["density"] < 1
    adapter = FocusAdapter.from_pretrained(ADAPTER)  # the window matches the mean of both prompts' focus density
    cfg, focus = adapter.config, [r["density"] for r in rows if r["mode"] == "focus"]
    w = matching_window(384, cfg.sink_tokens, sum(focus) / len(focus), cfg.tail(384))
    assert {r["density"] for r in rows if r["mode"] == "window"} == {window_density(384, w, cfg.sink_tokens,
                                                                                   cfg.tail(384))}
    assert main([*argv, "--depths", "30", "--window", "128", "--resume", str(first / P.PASSKEY_JSON),
                 "--output-dir", str(tmp_path / "other")]) == 2
    assert "differs in window: 256 there, 128 here" in capsys.readouterr().err
    assert main([*argv, "--depths", "30", "--dtype", "bfloat16", "--resume", str(first / P.PASSKEY_JSON),
                 "--output-dir", str(tmp_path / "other")]) == 2
    assert "was run in float32, this run in bfloat16" in capsys.readouterr().err
    assert main([*argv, "--depths", "30", "--model", str(tmp_path / "another-model"), "--resume",
                 str(first / P.PASSKEY_JSON), "--output-dir", str(tmp_path / "other")]) == 2
    assert "was run on the model 'HuggingFaceTB/SmolLM2-135M-Instruct' (revision None), this run on '" in (
        capsys.readouterr().err)


@pytest.mark.slow
def test_eval_task_passkey_stopped_midway_continues_from_its_saved_results(tmp_path, capsys):
    """A run stopped (Ctrl-C) after some prompts has saved them (``passkey.partial.json``, after every prompt; not
    the rows of ``--full-results``, which the same command reads again) and says where; a new run into the same
    folder refuses to start over them, and with ``--resume`` takes them and runs only the rest."""
    out = tmp_path / "pk"
    argv = ["eval", ADAPTER, "--task", "passkey", "--lengths", "1024", "--depths", "30", "70", "--keys-per-cell", "1",
            "--haystacks", "prose", "--phrasings", "ruler", "--modes", "focus", "window", "--full-results",
            str(Path(ADAPTER) / P.PASSKEY_JSON), "--output-dir", str(out), "--no-progress"]
    partial = out / P.PASSKEY_PARTIAL
    run = subprocess.Popen([sys.executable, "-m", "focus_flex.cli", *argv], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        while not partial.exists() and run.poll() is None:
            time.sleep(0.01)
        run.send_signal(signal.SIGINT)  # Ctrl-C
        stderr = run.communicate(timeout=60)[1].decode()
    finally:
        run.kill()
    assert run.returncode == -signal.SIGINT, stderr[-2000:]
    assert f"stopped: the results so far are in {partial}; continue with --resume {partial}" in stderr
    saved = json.loads(partial.read_text())["results"]
    assert 1 <= len(saved) < 4 and {r["mode"] for r in saved} == {"focus"}
    assert not (out / P.PASSKEY_JSON).exists()
    assert main(argv) == 2
    assert f"continue it by passing --resume {partial}" in capsys.readouterr().err
    assert main([*argv, "--resume", str(partial)]) == 0
    assert (f"--resume: {len(saved)} of 6 results taken from {partial}, 2 from --full-results, {4 - len(saved)} run"
            in capsys.readouterr().out)
    rows = json.loads((out / P.PASSKEY_JSON).read_text())["results"]
    assert [r["mode"] for r in rows] == ["full"] * 2 + ["focus"] * 2 + ["window"] * 2
    assert rows[2:2 + len(saved)] == saved and {r["depth"] for r in rows} == {30, 70}
    assert not partial.exists()  # the finished run's report replaces the results so far


def test_a_focus_prompt_that_fails_before_any_focus_layer_raises_its_own_error(smollm2):
    """An error (or Ctrl-C) before the first Focus layer runs reaches the caller as itself: the density meter, which
    then has counted nothing, does not replace it; the adapter is detached."""
    model, tokenizer = smollm2
    adapter = FocusAdapter.from_pretrained(ADAPTER)
    cell = P.Prompt("prose", 384, 50, 0, "ruler")
    prompt = cell.build(tokenizer, cell.key())
    prompt.input_ids = prompt.input_ids.clone()
    prompt.input_ids[-1] = model.config.vocab_size  # a token the model has no embedding for
    with pytest.raises(IndexError):
        P._run(model, tokenizer, adapter, "focus", cell, prompt, [])
    assert not has_focus(model)


def test_window_only_is_matched_to_focus_on_the_prompts_of_its_own_phrasing(smollm2):
    """Each phrasing's window-only density is matched to Focus's mean density over that phrasing's prompts. The two
    phrasings' densities differ by little, so the test runs lengths until their matched windows differ (there,
    pooling both phrasings would give one of them the other's window)."""
    model, tokenizer = smollm2
    adapter = FocusAdapter.from_pretrained(ADAPTER)
    cfg, tried = adapter.config, {}
    for n in (448, 640, 512, 384):
        rows = P.passkey_eval(model, tokenizer, adapter, lengths=[n], depths=[10, 50], keys_per_cell=1,
                              haystacks=["prose"], modes=["focus", "window"], progress=False)
        tail, windows = cfg.tail(n), {}
        for phrasing in P.PHRASINGS:
            focus = [r.density for r in rows if (r.mode, r.phrasing) == ("focus", phrasing)]
            windows[phrasing] = matching_window(n, cfg.sink_tokens, sum(focus) / len(focus), tail)
            expected = window_density(n, windows[phrasing], cfg.sink_tokens, tail)
            assert all(r.density == expected for r in rows if (r.mode, r.phrasing) == ("window", phrasing))
        tried[n] = windows
        if len(set(windows.values())) == len(P.PHRASINGS):
            break
    else:
        pytest.fail(f"the phrasings' matched windows coincide at every length tried, {tried}: add a length")


@pytest.mark.slow
def test_eval_task_passkey_reuses_an_older_run_for_its_phrasing_only(tmp_path, capsys):
    """Results written before phrasings existed are the passkey's: asking for RULER's too names what the file holds."""
    assert main(["eval", ADAPTER, "--task", "passkey", "--lengths", "1024", "--depths", "10", "--keys-per-cell", "1",
                 "--modes", "full", "focus", "--full-results", str(OLDER_RUN), "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no full-attention result for 2 of the 4 prompts" in err and "(--phrasings passkey)" in err


@pytest.mark.parametrize("argv,match", [
    (["--depths", "150"], "0 to 100"),
    (["--keys-per-cell", "0"], ">= 1"),
    (["--modes", "soft"], "runs full, focus, window"),
    (["--modes", "full", "window"], "needs focus"),
])
def test_eval_task_passkey_rejects_bad_flags_before_loading_a_model(argv, match, capsys):
    assert main(["eval", ADAPTER, "--task", "passkey", *argv]) == 2
    assert match in capsys.readouterr().err


def test_eval_rejects_an_unknown_task(capsys):
    with pytest.raises(SystemExit):
        main(["eval", ADAPTER, "--task", "needle"])
    assert "invalid choice: 'needle'" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_task_passkey_rejects_lengths_above_the_context(tmp_path, capsys):
    assert main(["eval", ADAPTER, "--task", "passkey", "--lengths", "2048", "9000",
                 "--output-dir", str(tmp_path)]) == 2
    assert "--lengths 9000" in capsys.readouterr().err


@pytest.mark.slow
def test_key_attention_finds_heads_reading_the_key_and_what_the_pattern_keeps(smollm2):
    model, tok = smollm2
    adapter = FocusAdapter.from_pretrained(ADAPTER)
    adapter.config.layer_top_k = []  # every layer with the adapter's top-k (one query group); layer 0's own below
    p = P.build_prompt(tok, 512, 20, "58213", "filler")
    ka = P.key_attention(model, tok, p, adapter)
    assert ka.mass.shape == ka.kept.shape == (30, 9) and ka.query_groups.shape == (30, 9, 6, 1)
    assert ka.key_groups.shape == (30, 3, 10, adapter.config.key_top_k)  # both copies of the 5 digits
    assert float(ka.mass.max()) > 0.3  # some head puts a third of the answer's attention on the key
    assert bool((ka.kept >= 0).all() and (ka.kept <= 1 + 1e-5).all() and (ka.kept_all <= 1 + 1e-5).all())
    assert float((ka.mass * ka.kept).sum() / ka.mass.sum()) < 0.9  # the needle is ~380 tokens back: some is lost
    adapter.config.window = 1024  # the whole prompt is local: the pattern is full attention
    wide = P.key_attention(model, tok, p, adapter)
    assert torch.allclose(wide.kept, torch.ones_like(wide.kept), atol=1e-4)
    assert torch.allclose(wide.kept_all, torch.ones_like(wide.kept_all), atol=1e-4)
    assert torch.equal(wide.mass, ka.mass)
    adapter.config.window, adapter.config.layer_top_k = 256, [[0, 63, 4]]  # layer 0's queries in every group
    own = P.key_attention(model, tok, p, adapter)
    assert torch.allclose(own.kept[0], torch.ones(9), atol=1e-4) and torch.equal(own.kept[1:], ka.kept[1:])
    assert own.query_groups.shape == (30, 9, 6, 63) and bool((own.query_groups[1:, ..., 1:] == -1).all())
    assert torch.equal(own.query_groups[1:, ..., :1], ka.query_groups[1:])


def test_retention_counts_only_the_keys_full_attention_retrieves():
    def row(mode, depth, correct, key="12345"):
        return P.PasskeyResult(mode, "prose", 1024, depth, 0, key, "", correct, depth, 1.0, 0.0)

    results = [row("full", 10, True), row("full", 50, False), row("full", 90, True),
               row("focus", 10, True), row("focus", 50, True), row("focus", 90, False)]
    assert [r.depth for r in P.retained(results, "focus")] == [10, 90]
    table = P.passkey_markdown(results)
    assert "| focus | 1/2: 50% [9-91%] | 1/2: 50% [9-91%] |" in table and "| focus | 2/3 | 2/3 |" in table
    assert "log-probability" not in table  # no result has one: no table of them


@pytest.mark.parametrize(("successes", "trials"), [(29, 35), (7, 11), (0, 8), (12, 12), (1, 2)])
def test_wilson_interval_holds_the_rates_within_z_standard_errors_of_the_share(successes, trials):
    low, high = P.wilson_interval(successes, trials)
    share = successes / trials
    assert 0 <= low <= share <= high <= 1
    for rate in (low, high):  # each bound solves |share - p| = z sqrt(p (1 - p) / n), unless it is 0 or 1
        if 0 < rate < 1:
            assert abs(abs(share - rate) - 1.96 * math.sqrt(rate * (1 - rate) / trials)) < 1e-12
    assert (low == 0) == (successes == 0) and (high == 1) == (successes == trials)
    with pytest.raises(ValueError, match="at least one trial"):
        P.wilson_interval(0, 0)


def test_markdown_compares_each_mode_with_full_attention_prompt_by_prompt():
    def row(mode, length, depth, correct, logprob):
        return P.PasskeyResult(mode, "prose", length, depth, 0, "12345", "", correct, depth, 1.0, 0.0, logprob, logprob)

    results = [row("full", 1024, 10, True, -1.0), row("full", 1024, 50, False, -3.0),
               row("full", 2048, 10, True, -0.5), row("full", 2048, 50, True, -0.5), row("full", 2048, 90, True, -0.5),
               row("focus", 1024, 10, False, -2.0), row("focus", 1024, 50, True, -3.0),  # lost one, gained one
               row("focus", 2048, 10, True, -0.5), row("focus", 2048, 50, True, -0.8),
               row("focus", 2048, 90, True, None),
               row("focus", 4096, 10, True, -0.1)]  # no full attention result for this prompt: not compared
    assert [f.length for _, f in P.paired(results, "focus")] == [1024, 1024, 2048, 2048, 2048]
    table = P.passkey_markdown(results)
    # differences 1K: -1.0, 0.0 (mean -0.5, s.e. 0.5); 2K: 0.0, -0.3 (the third unmeasured); all: the four
    all_four = [-1.0, 0.0, 0.0, -0.3]
    se = statistics.stdev(all_four) / len(all_four) ** 0.5
    assert (f"| focus | -0.50 ± 0.50, -1/+1 | -0.15 ± 0.15, -0/+0 | -, -0/+0 | "
            f"{statistics.fmean(all_four):+.2f} ± {se:.2f}, -1/+1 |") in table


def test_markdown_averages_the_key_logprob_and_older_results_load_without_one():
    def row(mode, length, logprob, first):
        return P.PasskeyResult(mode, "filler", length, 50, 0, "12345", "", False, 50, 1.0, 0.0, logprob, first)

    table = P.passkey_markdown([row("full", 1024, -0.5, -0.25), row("full", 1024, -1.5, -1.0),
                                row("full", 2048, None, None), row("focus", 1024, -4.0, -3.0),
                                row("focus", 2048, -6.0, -1.0)])
    assert "| full | -1.00 (-0.62; -0.38) | - | -1.00 (-0.62; -0.38) |" in table
    assert "| focus | -4.00 (-3.00; -1.00) | -6.00 (-1.00; -5.00) | -5.00 (-2.00; -3.00) |" in table
    old = P.load_passkey(OLDER_RUN)  # written before the key's log-probability was measured
    assert old and all(r.key_logprob is None and r.phrasing == "passkey" for r in old)


def test_protocol_names_the_phrasings_evaluated_each_on_one_line():
    both, ruler = P.passkey_protocol("float32"), P.passkey_protocol("float32", phrasings=["ruler"])
    assert "\n" not in both and "The pass key is NNNNN." in both and "quiet-harbor is: NNNNN." in both
    assert 'answer started as "The special magic numbers for quiet-harbor mentioned in the provided text is:\\n\\n-"' \
        in ruler and "pass key" not in ruler
