"""Tests of the focus-flex command: retrofit/eval end to end on a tiny local model, errors, the real default model."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from focus_flex import FocusAdapter, hub
from focus_flex.cli import DEFAULT_FOCUS, build_parser, keep_freed_memory, main
from focus_flex.evaluate import MODES, PLOT_PNG, RESULTS_JSON, RESULTS_MD

WORDS = [f"w{i}" for i in range(90)]
TINY = ["--context", "64", "--seq-len", "48", "--groups", "4", "--key-top-k", "1", "--window", "8", "--sinks", "2",
        "--query-samples", "8", "--eval-windows", "2", "--no-progress"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer, training texts and held-out texts."""
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(root / "model")
    rng = random.Random(0)
    for split, books in (("train", 3), ("eval", 1)):
        (root / split).mkdir()
        for b in range(books):
            (root / split / f"book{b}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(400)))
    return root


def test_retrofit_then_eval(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["retrofit", "--model", str(tiny / "model"), "--data", str(tiny / "train"), "--eval-data",
            str(tiny / "eval"), "--steps", "2", "--output-dir", str(out), *TINY]
    assert main(argv) == 0
    adapter_dir = out / "adapter"
    files = set(os.listdir(adapter_dir))
    assert {"focus_config.json", "focus_adapter.safetensors", "README.md", RESULTS_JSON, RESULTS_MD, PLOT_PNG} <= files
    assert os.path.isdir(out / "checkpoints" / "step-000002")
    adapter = FocusAdapter.from_pretrained(str(adapter_dir))
    extra = adapter.config.extra
    assert adapter.config.num_groups == 4 and adapter.config.window == 8
    assert extra["command"] == "focus-flex " + " ".join(argv)
    assert extra["training"]["base_model_unchanged"] and extra["training"]["steps"] == 2
    assert set(extra["results"]) == set(MODES)
    card = (adapter_dir / "README.md").read_text()
    assert "library_name: focus_flex" in card and "| focus |" in card and PLOT_PNG in card and argv[0] in card
    results = json.loads((adapter_dir / RESULTS_JSON).read_text())
    assert [r["mode"] for r in results["results"]] == list(MODES) and len(results["history"]) == 2
    assert "| window |" in capsys.readouterr().out

    evald = tmp_path / "eval"
    assert main(["eval", str(adapter_dir), "--model", str(tiny / "model"), "--eval-data", str(tiny / "eval"),
                 "--context", "64", "--eval-windows", "1", "--modes", "full", "focus", "--output-dir", str(evald),
                 "--no-progress"]) == 0
    results = json.loads((evald / RESULTS_JSON).read_text())
    assert [r["mode"] for r in results["results"]] == ["full", "focus"]
    assert results["results"][1]["density"] < 1

    # The same centroids with keys in 2 of the 4 groups: more far pairs, and the saved copy says so.
    wider = tmp_path / "eval-k2"
    assert main(["eval", str(adapter_dir), "--model", str(tiny / "model"), "--data", str(tiny / "eval"),  # all of it
                 "--context", "64", "--eval-windows", "1", "--modes", "focus", "--key-top-k", "2",
                 "--output-dir", str(wider), "--no-progress"]) == 0
    density = json.loads((wider / RESULTS_JSON).read_text())["results"][0]["density"]
    assert results["results"][1]["density"] < density < 1
    assert FocusAdapter.from_pretrained(str(wider)).config.key_top_k == 2
    assert torch.equal(FocusAdapter.from_pretrained(str(wider)).centroids, adapter.centroids)
    card = (wider / "README.md").read_text()  # how the centroids were made, then how this copy was evaluated
    assert card.index(extra["command"]) < card.index("# then evaluated with:") < card.index("--key-top-k 2")
    assert main(["eval", str(adapter_dir), "--key-top-k", "5", "--no-progress"]) == 2
    assert "--key-top-k 5: the adapter has 4 groups" in capsys.readouterr().err
    # A narrower window and dense decode steps: fewer pairs in the prefill, and the saved copy says so.
    narrower = tmp_path / "eval-w4"
    assert main(["eval", str(adapter_dir), "--model", str(tiny / "model"), "--data", str(tiny / "eval"),
                 "--context", "64", "--eval-windows", "1", "--modes", "focus", "--window", "4", "--dense-decode",
                 "--dense-tail", "3", "--output-dir", str(narrower), "--no-progress"]) == 0
    narrow_density = json.loads((narrower / RESULTS_JSON).read_text())["results"][0]["density"]
    assert narrow_density < results["results"][1]["density"]
    config = FocusAdapter.from_pretrained(str(narrower)).config
    assert config.window == 4 and config.dense_decode and not adapter.config.dense_decode
    # More sinks: every query attends the first 16 tokens, more pairs than the same settings with 2.
    sunk = tmp_path / "eval-s16"
    assert main(["eval", str(adapter_dir), "--model", str(tiny / "model"), "--data", str(tiny / "eval"),
                 "--context", "64", "--eval-windows", "1", "--modes", "focus", "--window", "4", "--sinks", "16",
                 "--dense-tail", "3", "--output-dir", str(sunk), "--no-progress"]) == 0
    assert json.loads((sunk / RESULTS_JSON).read_text())["results"][0]["density"] > narrow_density
    assert FocusAdapter.from_pretrained(str(sunk)).config.sink_tokens == 16 and adapter.config.sink_tokens == 2
    assert main(["eval", str(adapter_dir), "--sinks", "-1", "--no-progress"]) == 2
    assert "--sinks -1: choose 0 or more sink tokens" in capsys.readouterr().err
    assert config.dense_tail == 3 and adapter.config.dense_tail == 0
    assert main(["eval", str(adapter_dir), "--dense-tail", "-2", "--no-progress"]) == 2
    assert "dense_tail=-2 must be an int >= 0" in capsys.readouterr().err
    assert main(["eval", str(adapter_dir), "--window", "0", "--no-progress"]) == 2
    assert "--window 0: choose a window >= 1 token" in capsys.readouterr().err
    for flags, message in ((["--modes"], "--modes needs at least one"), (["--eval-windows", "0"], "must be >= 1"),
                           (["--device", "banana"], "--device 'banana' cannot be used")):
        assert main(["eval", str(adapter_dir), "--model", "/nonexistent", *flags, "--no-progress"]) == 2
        assert message in capsys.readouterr().err  # (before the model is looked for)


@pytest.mark.parametrize("flags,center", [([], [1]), (["--center"], True), (["--center", "0"], [0]),
                                          (["--no-center"], False)])
def test_retrofit_centered_then_eval(tiny, tmp_path, flags, center):
    """--center [LAYER ...] (default: the upper half of the layers, here layer 1 of 2): the adapter holds the
    calibrated means of the centered layers, evaluation routes with them, the card lists the setting."""
    out = tmp_path / "run"
    model, held_out = ["--model", str(tiny / "model")], ["--eval-data", str(tiny / "eval")]
    assert main(["retrofit", *model, "--data", str(tiny / "train"), *held_out, "--steps", "1", *flags,
                 "--modes", "full", "focus", "--output-dir", str(out), *TINY]) == 0
    adapter = FocusAdapter.from_pretrained(str(out / "adapter"))
    assert adapter.config.center == center
    if center is False:
        assert adapter.key_means is None
    else:
        assert [bool(adapter.key_means[i].any()) for i in (0, 1)] == [adapter.config.centers(i) for i in (0, 1)]
        assert [bool(adapter.query_means[i].any()) for i in (0, 1)] == [adapter.config.centers(i) for i in (0, 1)]
    assert f"| `center` | `{json.dumps(center)}` |" in (out / "adapter" / "README.md").read_text()
    assert main(["eval", str(out / "adapter"), *model, *held_out, "--context", "64", "--eval-windows", "1",
                 "--modes", "focus", "--output-dir", str(tmp_path / "eval"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "eval" / RESULTS_JSON).read_text())["results"][0]["density"] < 1


def test_retrofit_fine_tunes_a_saved_adapter(tiny, tmp_path, capsys):
    """--init-from: training starts from the saved centroids and keeps the saved Focus settings (here: kd)."""
    data = ["--model", str(tiny / "model"), "--data", str(tiny / "train"), "--eval-data", str(tiny / "eval")]
    assert main(["retrofit", *data, "--steps", "1", "--modes", "--output-dir", str(tmp_path / "first"), *TINY]) == 0
    start = FocusAdapter.from_pretrained(str(tmp_path / "first" / "adapter"))
    plain = ["--context", "64", "--seq-len", "48", "--eval-windows", "1", "--no-progress"]  # no Focus flags
    assert main(["retrofit", *data, "--init-from", str(tmp_path / "first" / "adapter"), "--objective", "kd",
                 "--steps", "1", "--lr", "1e-3", "--modes", "full", "focus", "--output-dir", str(tmp_path / "tuned"),
                 *plain]) == 0
    tuned = FocusAdapter.from_pretrained(str(tmp_path / "tuned" / "adapter"))
    assert {**tuned.config.to_dict(), "extra": None} == {**start.config.to_dict(), "extra": None}
    assert 0 < (tuned.centroids - start.centroids).abs().max() < 0.01  # one small step from them, not a new k-means
    assert tuned.config.extra["init_from"] == str(tmp_path / "first" / "adapter")
    assert tuned.config.extra["training"]["objective"] == "kd" and "results" in tuned.config.extra
    capsys.readouterr()
    for flags, message in ((["--window", "8"], "drop --window (to change a setting, edit focus_config.json"),
                           (["--init", "random"], "drop --init")):
        assert main(["retrofit", *data, "--init-from", str(tmp_path / "first" / "adapter"), *flags,
                     "--output-dir", str(tmp_path / "bad"), *plain]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--model", "MODEL/../nope"], "cannot load model"),
    (["--data", "TINY/missing.txt", "--eval-data", "TINY/eval"], "cannot read the training data"),
    (["--data", "TINY/train", "--eval-data", "TINY/missing"], "cannot read the evaluation data"),
    (["--data", "TINY/train"], "no held-out split: pass --eval-data"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--context", "512"], "longer than the 256 tokens"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--context", "4000"], "longer than the 256 tokens"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--key-top-k", "4"], "every key would join every group"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--seq-len", "10"], "nothing for the centroids to learn"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--context", "0"], "--context 0: must be >= 1"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--steps", "0"], "invalid settings: steps=0"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--tau", "inf"], "invalid settings: Invalid FocusConfig"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--device", "banana"], "cannot be used here"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--device", "cuda:7"], "cannot be used here"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--modes", "window"], "--modes window needs focus too"),
    (["--data", "TINY/train", "--eval-data", "TINY/train/book0.txt"], "shares 1 file(s) with the training text"),
    (["--train-split", "eval"], "shares 2 file(s) with the training text"),  # the shipped held-out books
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--balance-weight", "nan"], "invalid settings"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--groups", "60"], "k-means init needs at least"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--repetitive", "-1"], "--repetitive -1: the number"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--repetitive", "2"],
     "--repetitive 2: training document 0 has 0 sentences"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--train-layers", "7"], "train_layers [7] are not Focus"),
    (["--data", "TINY/train", "--eval-data", "TINY/eval", "--train-layers", "0", "0"], "invalid settings: train_"),
])
def test_retrofit_errors_are_clear(tiny, tmp_path, capsys, args, message):
    args = [a.replace("MODEL", str(tiny / "model")).replace("TINY", str(tiny)) for a in args]
    if "--model" not in args:
        args += ["--model", str(tiny / "model")]
    argv = ["retrofit", *TINY, "--steps", "1", "--output-dir", str(tmp_path), *args]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_retrofit_refuses_one_split_of_a_saved_dataset_for_both(tiny, tmp_path, capsys):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["a training text", "another"]}).save_to_disk(str(saved))
    argv = ["retrofit", *TINY, "--steps", "1", "--output-dir", str(tmp_path / "out"), "--model", str(tiny / "model"),
            "--data", str(saved), "--eval-data", f"{saved}/", "--eval-split", "train"]
    assert main(argv) == 2
    assert "--data and --eval-data are the same split 'train'" in capsys.readouterr().err


def test_retrofit_output_dir_holds_one_run(tiny, tmp_path, capsys):
    """A fresh run does not mix with an earlier run's checkpoints; --resume continues only the same settings; a
    run without evaluation leaves no results behind."""
    out = tmp_path / "run"
    base = ["retrofit", "--model", str(tiny / "model"), "--data", str(tiny / "train"), "--eval-data",
            str(tiny / "eval"), *TINY, "--output-dir", str(out), "--checkpoint-every", "1"]
    assert main([*base, "--steps", "2"]) == 0
    adapter_dir = out / "adapter"
    assert (adapter_dir / RESULTS_JSON).is_file()
    capsys.readouterr()
    for extra, message in ((["--steps", "3"], "holds checkpoints of an earlier run: pass --resume to continue it, "
                                               "--overwrite"),
                           (["--steps", "3", "--resume", "--seed", "7"], "seed: 0 there, 7 now"),
                           (["--steps", "1", "--resume"], "at step 2, past --steps 1")):
        assert main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    assert main([*base, "--steps", "3", "--resume", "--modes"]) == 0  # continued, no evaluation this time
    assert FocusAdapter.from_pretrained(str(adapter_dir)).config.extra["training"]["steps"] == 3
    assert not (adapter_dir / RESULTS_JSON).exists() and "## Results" not in (adapter_dir / "README.md").read_text()
    assert main([*base, "--steps", "1", "--modes", "--overwrite"]) == 0  # starts over: only its own checkpoint
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000001"]


def test_default_evaluation_sources_and_output_folder(tiny, tmp_path, monkeypatch):
    from argparse import Namespace

    from focus_flex.cli import _eval_source

    def source(**kw):
        return _eval_source(Namespace(**{"data": None, "eval_data": None, "eval_split": None, **kw}))

    assert source() == (None, "eval")  # the shipped held-out books
    assert source(data="user/ds") == ("user/ds", "validation")
    assert source(eval_data="user/other") == ("user/other", "validation")  # a dataset's usual held-out split
    assert source(eval_data=str(tiny / "eval")) == (str(tiny / "eval"), "eval")
    # eval's default output folder names the run, not just `adapter` (every retrofit saves RUN/adapter)
    run = tmp_path / "retrofit-x"
    FocusAdapter.for_model(LlamaForCausalLM.from_pretrained(tiny / "model"), DEFAULT_FOCUS).save_pretrained(
        run / "adapter")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(run / "adapter"), "--model", str(tiny / "model"), "--eval-data", str(tiny / "eval"),
                 "--context", "64", "--eval-windows", "1", "--modes", "full", "--no-progress"]) == 0
    assert (tmp_path / "runs" / "eval-retrofit-x-adapter" / RESULTS_JSON).is_file()


def test_eval_of_a_missing_adapter(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "none"), "--no-progress"]) == 2
    assert "cannot load adapter" in capsys.readouterr().err


def test_hub_commands_are_registered():
    parser = build_parser()
    assert parser.parse_args(["push", "dir", "me/repo"]).func is hub.cmd_push
    assert parser.parse_args(["pull", "me/repo"]).func is hub.cmd_pull


@pytest.mark.slow
def test_retrofit_default_model_end_to_end(tmp_path):
    """The real SmolLM2-135M-Instruct and shipped books, with tiny settings (~1-2 min on 2 CPU cores)."""
    out = tmp_path / "run"
    assert main(["retrofit", "--context", "512", "--seq-len", "512", "--steps", "2", "--query-samples", "64",
                 "--eval-windows", "1", "--output-dir", str(out), "--no-progress"]) == 0
    adapter = FocusAdapter.from_pretrained(str(out / "adapter"))
    assert adapter.config.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert tuple(adapter.centroids.shape) == (30, 3, DEFAULT_FOCUS.num_groups, 64)
    res = {r["mode"]: r for r in json.loads((out / "adapter" / RESULTS_JSON).read_text())["results"]}
    assert set(res) == set(MODES)
    assert 5 < res["full"]["perplexity"] < 100  # real text, real model
    assert res["focus"]["density"] < 1 and res["window"]["density"] >= res["focus"]["density"]
    assert res["focus"]["perplexity"] < 2 * res["full"]["perplexity"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_keep_freed_memory_applies_on_glibc():
    assert keep_freed_memory()
