"""The examples in ``examples/``: notebooks in sync with their scripts, no committed outputs, and every
notebook executes end to end (small settings: ``FOCUS_FLEX_EXAMPLES_SMALL=1``) with the real SmolLM2."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = ("finetune_centroids", "use_adapter", "inspect_groups")
FINETUNED = "runs/examples/finetune_centroids/adapter"  # where finetune_centroids saves (relative to its cwd)


def _builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", EXAMPLES / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_built():
    assert tuple(_builder().SOURCES) == tuple(f"{n}.py" for n in NOTEBOOKS)
    assert sorted(p.stem for p in EXAMPLES.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_matches_script_and_has_no_outputs(name):
    committed = (EXAMPLES / f"{name}.ipynb").read_text(encoding="utf-8")
    assert committed == _builder().notebook_text(EXAMPLES / f"{name}.py"), (
        f"examples/{name}.ipynb is out of date: run `python examples/build_notebooks.py`")
    nb = nbformat.reads(committed, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_first_code_cell_is_the_parameter_cell(name):
    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.metadata.get("tags") == ["parameters"]
    assert "FOCUS_FLEX_EXAMPLES_SMALL" in first.source
    ast.parse(first.source)  # plain assignments a user edits
    assert "import torch" not in first.source


def test_build_parses_percent_format(tmp_path):
    script = tmp_path / "demo.py"
    script.write_text('# ruff: noqa: E402\n# %% [markdown]\n# # Title\n#\n# text\n\n# %% tags=["parameters"]\nX = 1\n\n'
                      "# %%\n\nprint(X)\n\n\n# %%\n\n")
    nb = _builder().build_notebook(script)
    assert [(c.cell_type, c.source) for c in nb.cells] == [
        ("markdown", "# Title\n\ntext"), ("code", "X = 1"), ("code", "print(X)")]
    assert nb.cells[1].metadata["tags"] == ["parameters"]
    assert nb.metadata["kernelspec"]["name"] == "python3"


def run_notebook(name: str, workdir: Path, params: dict | None = None, check: str = "") -> nbformat.NotebookNode:
    """Execute examples/<name>.ipynb in ``workdir`` in small mode (``params`` override the parameter cell, as
    papermill would; ``check``, code run last, in the notebook's namespace); returns the executed notebook. Fails on
    the first cell that raises."""
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    if params:
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items())))
    # The kernel must be this interpreter (jupyter_client runs the "python3" kernel with sys.executable);
    # check it, so that a notebook never silently runs against another installation.
    nb.cells.insert(0, nbformat.v4.new_code_cell(f"import sys\nassert sys.prefix == {sys.prefix!r}, sys.prefix"))
    if check:
        nb.cells.append(nbformat.v4.new_code_cell(check))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_FLEX_EXAMPLES_SMALL", "1")
        mp.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        mp.setenv("HF_HUB_OFFLINE", "1")  # an example must not need the network by default
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
            mp.delenv(var, raising=False)
        NotebookClient(nb, kernel_name="python3", timeout=900, resources={"metadata": {"path": str(workdir)}}).execute()
    return nb


def images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """finetune_centroids run once in a fresh working directory; the other notebooks then use its adapter
    (so they need not train one, and they reuse its compiled kernels from the inductor cache)."""
    workdir = tmp_path_factory.mktemp("examples")
    return run_notebook("finetune_centroids", workdir), workdir


@pytest.mark.slow
def test_finetune_centroids_runs(finetuned):
    nb, workdir = finetuned
    adapter_dir = workdir / FINETUNED
    assert (adapter_dir / "focus_config.json").is_file() and (adapter_dir / "focus_adapter.safetensors").is_file()
    from focus_flex import FocusAdapter

    adapter = FocusAdapter.from_pretrained(adapter_dir)
    assert {"perplexity (full)", "perplexity (focus)"} <= set(adapter.config.extra["results"])
    assert images(nb) == 2  # training curve and perplexity, shown inline
    assert "nothing pushed" in "".join(o.get("text", "") for o in nb.cells[-1].outputs)


@pytest.mark.slow
def test_use_adapter_runs(finetuned):
    nb = run_notebook("use_adapter", finetuned[1], {"ADAPTER": FINETUNED})
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "speed-up:" in text and "grows with the context length" in text


@pytest.mark.slow
def test_inspect_groups_runs(finetuned):
    workdir = finetuned[1]
    nb = run_notebook("inspect_groups", workdir, {"ADAPTER": FINETUNED})
    for fig in ("group_sizes", "attention_pattern"):
        assert (workdir / "runs" / "examples" / "inspect_groups" / f"{fig}.png").stat().st_size > 1000
    assert images(nb) == 2, "both figures are shown inline"


# The notebook's picture against what the attached adapter routes (adapter.routed: its own centering), then the
# pattern of those vectors by the plain semantics.
ROUTED_AS_THE_ADAPTER = """
import dataclasses
adapter.attach(model)
q_ref, k_ref = adapter.routed(adapter.slot[layer], q, k)
adapter.detach(model)
assert adapter.config.centers(layer), "the check needs a centered layer"
plain = dataclasses.replace(cfg, center=False)
assert torch.equal(pattern, focus_pattern(q_ref, k_ref, cent, plain)[0, h])
assert torch.equal(q_member, routing.hard_membership(q_ref, cent, cfg.query_top_k)[0, h])
assert torch.equal(k_member, routing.hard_membership(k_ref, cent, cfg.key_top_k)[0, kv])
"""


@pytest.mark.slow
def test_inspect_groups_routes_what_a_centered_adapter_routes(tmp_path):
    """The published adapter centers layers 15-29: the notebook's groups and pattern are those of the mean-removed
    vectors there, as the attached adapter routes them."""
    published = str(EXAMPLES.parent / "hub" / "smollm2-135m-instruct-focus")
    run_notebook("inspect_groups", tmp_path, {"ADAPTER": published, "PATTERN_LAYER": 20}, check=ROUTED_AS_THE_ADAPTER)
