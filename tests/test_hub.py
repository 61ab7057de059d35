"""Hub sharing of Focus adapters against a local Hub-protocol server (tests/hub_server.py).

The real `huggingface_hub` client does real HTTP to 127.0.0.1: see the `hub_server` fixture in conftest.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import warnings

import huggingface_hub
import huggingface_hub.constants as C
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from focus_flex import FocusAdapter, hub
from focus_flex.cli import DEFAULT_FOCUS
from focus_flex.config import CONFIG_NAME, WEIGHTS_NAME, FocusConfig

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHA = re.compile(r"[0-9a-f]{40}")


def make_adapter(folder, seed=0, *, base_model=BASE, model_type="llama", readme=True, repo_id=None):
    """A hand-made adapter folder: config + centroids [layers, kv heads, G, head dim] (+ a model card)."""
    cfg = FocusConfig(num_groups=4, layers=[0, 2], num_layers=3, num_kv_heads=3, head_dim=8,
                      base_model=base_model, model_type=model_type, base_model_revision="abc123")
    cfg.save_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    centroids = torch.randn(2, 3, 4, 8, generator=g)
    save_file({"centroids": centroids}, os.path.join(folder, WEIGHTS_NAME))
    if readme:
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(hub.model_card(cfg.to_dict(), repo_id=repo_id))
    return cfg, centroids


def assert_same_adapter(path, cfg, centroids):
    assert sorted(f for f in os.listdir(path) if not f.startswith(".")) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    assert FocusConfig.from_pretrained(path) == cfg
    got = load_file(os.path.join(path, WEIGHTS_NAME))["centroids"]
    assert got.dtype == centroids.dtype and torch.equal(got, centroids)  # bit-exact


def commit_sha(url):
    m = re.search(r"/commit/([0-9a-f]{40})$", url)
    assert m, url
    return m.group(1)


def cli(*argv):
    parser = argparse.ArgumentParser(prog="focus-flex")
    hub.add_hub_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


# ---- push / pull --------------------------------------------------------------------------------
def test_push_then_pull_round_trip(hub_server, tmp_path):
    cfg, centroids = make_adapter(tmp_path / "ad", repo_id="alice/focus-smol")
    url = hub.push_folder_to_hub(tmp_path / "ad", "alice/focus-smol", token="hf_alice")
    assert url.startswith(f"{hub_server.url}/alice/focus-smol/commit/")
    sha = commit_sha(url)

    # One commit on top of the repo's initial commit, with exactly the folder's files.
    repo = hub_server.hub.repos["alice/focus-smol"]
    commit = repo.commits[sha]
    assert repo.refs["main"] == sha and repo.commits[commit.parent].parent is None
    assert sorted(commit.files) == sorted([".gitattributes", "README.md", CONFIG_NAME, WEIGHTS_NAME])
    assert commit.files[WEIGHTS_NAME] == (tmp_path / "ad" / WEIGHTS_NAME).read_bytes()
    assert not repo.private

    path = hub.resolve_adapter_dir("alice/focus-smol")
    assert path.startswith(C.HF_HUB_CACHE) and os.path.basename(path) == sha
    assert_same_adapter(path, cfg, centroids)
    # Same commit again: answered from the cache (one HEAD per file, no GET).
    n_get = sum(m == "GET" for m, _ in hub_server.requests)
    assert hub.resolve_adapter_dir("alice/focus-smol", revision=sha) == path
    assert sum(m == "GET" for m, _ in hub_server.requests) == n_get


def test_second_push_and_first_revision_by_sha(hub_server, tmp_path):
    cfg1, c1 = make_adapter(tmp_path / "v1", seed=1)
    cfg2, c2 = make_adapter(tmp_path / "v2", seed=2)
    sha1 = commit_sha(hub.push_folder_to_hub(tmp_path / "v1", "alice/ad", token="hf_alice"))
    sha2 = commit_sha(hub.push_folder_to_hub(tmp_path / "v2", "alice/ad", token="hf_alice",
                                             commit_message="retrained"))
    assert sha1 != sha2
    repo = hub_server.hub.repos["alice/ad"]
    assert repo.commits[sha2].parent == sha1 and repo.commits[sha2].message == "retrained"

    latest = hub.resolve_adapter_dir("alice/ad")
    assert os.path.basename(latest) == sha2
    assert_same_adapter(latest, cfg2, c2)
    first = hub.resolve_adapter_dir("alice/ad", revision=sha1)
    assert os.path.basename(first) == sha1
    assert_same_adapter(first, cfg1, c1)
    assert not torch.equal(c1, c2)
    # Pushing identical files again makes no empty commit: the URL of the current commit comes back.
    assert commit_sha(hub.push_folder_to_hub(tmp_path / "v2", "alice/ad", token="hf_alice")) == sha2
    assert len(repo.commits) == 3


def test_branch(hub_server, tmp_path):
    cfg1, c1 = make_adapter(tmp_path / "v1", seed=1)
    cfg2, c2 = make_adapter(tmp_path / "v2", seed=2)
    hub.push_folder_to_hub(tmp_path / "v1", "alice/ad", token="hf_alice")
    url = hub.push_folder_to_hub(tmp_path / "v2", "alice/ad", token="hf_alice", revision="dev")
    sha_dev = commit_sha(url)
    repo = hub_server.hub.repos["alice/ad"]
    # The branch was created from main; main is untouched.
    assert repo.refs["dev"] == sha_dev and repo.refs["main"] != sha_dev
    assert_same_adapter(hub.resolve_adapter_dir("alice/ad", revision="dev"), cfg2, c2)
    assert_same_adapter(hub.resolve_adapter_dir("alice/ad"), cfg1, c1)
    # Pushing to the existing branch again moves it forward.
    _, c3 = make_adapter(tmp_path / "v3", seed=3)
    sha3 = commit_sha(hub.push_folder_to_hub(tmp_path / "v3", "alice/ad", token="hf_alice", revision="dev"))
    assert repo.commits[sha3].parent == sha_dev
    assert torch.equal(load_file(os.path.join(hub.resolve_adapter_dir("alice/ad", revision="dev"),
                                              WEIGHTS_NAME))["centroids"], c3)


def test_push_as_pull_request(hub_server, tmp_path):
    make_adapter(tmp_path / "v1", seed=1)
    _, c2 = make_adapter(tmp_path / "v2", seed=2)
    sha1 = commit_sha(hub.push_folder_to_hub(tmp_path / "v1", "alice/ad", token="hf_alice"))
    sha2 = commit_sha(hub.push_folder_to_hub(tmp_path / "v2", "alice/ad", token="hf_alice", create_pr=True))
    repo = hub_server.hub.repos["alice/ad"]
    assert repo.refs["main"] == sha1 and repo.refs["refs/pr/1"] == sha2
    path = hub.resolve_adapter_dir("alice/ad", revision="refs/pr/1")
    assert torch.equal(load_file(os.path.join(path, WEIGHTS_NAME))["centroids"], c2)


def test_private_repo_with_and_without_token(hub_server, tmp_path, monkeypatch):
    cfg, centroids = make_adapter(tmp_path / "ad")
    hub.push_folder_to_hub(tmp_path / "ad", "alice/secret", token="hf_alice", private=True)
    assert hub_server.hub.repos["alice/secret"].private

    with pytest.raises(hub.AdapterRepoNotFoundError) as e:
        hub.resolve_adapter_dir("alice/secret")
    msg = str(e.value)
    assert "'alice/secret'" in msg and "private" in msg and "token=" in msg and "hf auth login" in msg

    # A valid token of an account without access: the Hub does not say "private", so neither do we.
    with pytest.raises(hub.AdapterRepoNotFoundError, match="a token was sent"):
        hub.resolve_adapter_dir("alice/secret", token="hf_bob")
    # An invalid token.
    with pytest.raises(hub.HubAuthError, match="invalid or expired"):
        hub.resolve_adapter_dir("alice/secret", token="hf_wrong")

    assert_same_adapter(hub.resolve_adapter_dir("alice/secret", token="hf_alice"), cfg, centroids)
    # The token of `hf auth login` / HF_TOKEN is used when token=None.
    monkeypatch.setenv("HF_TOKEN", "hf_alice")
    other_cache = str(tmp_path / "other_cache")
    assert_same_adapter(hub.resolve_adapter_dir("alice/secret", cache_dir=other_cache), cfg, centroids)


# ---- errors -------------------------------------------------------------------------------------
def test_repo_not_found(hub_server, tmp_path):
    with pytest.raises(hub.AdapterRepoNotFoundError, match="'alice/nothing-here' was not found"):
        hub.resolve_adapter_dir("alice/nothing-here")
    # A path that is not a directory and not a valid repo id either.
    with pytest.raises(hub.AdapterRepoNotFoundError, match="neither an existing local directory") as e:
        hub.resolve_adapter_dir(str(tmp_path / "no" / "such" / "folder"))
    assert "repo_type" not in str(e.value)  # (huggingface_hub's advice for its own API is noise here)
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(hub.AdapterRepoNotFoundError, match="is a file; pass the folder"):
        hub.resolve_adapter_dir(str(tmp_path / "f.txt"))
    with pytest.raises(hub.AdapterRepoNotFoundError, match="has no subfolder 'nope'"):
        hub.resolve_adapter_dir(str(tmp_path), subfolder="nope")
    with pytest.raises(ValueError, match="local folder, which has no revisions"):
        hub.resolve_adapter_dir(str(tmp_path), revision="v1")
    assert isinstance(hub.AdapterRepoNotFoundError("x"), OSError)


def test_file_missing_in_repo(hub_server, tmp_path):
    api = huggingface_hub.HfApi()
    api.create_repo("alice/half", token="hf_alice")
    FocusConfig().save_pretrained(tmp_path / "half")
    api.upload_file(path_or_fileobj=str(tmp_path / "half" / CONFIG_NAME), path_in_repo=CONFIG_NAME,
                    repo_id="alice/half", token="hf_alice")
    with pytest.raises(hub.AdapterFileNotFoundError) as e:
        hub.resolve_adapter_dir("alice/half")
    assert WEIGHTS_NAME in str(e.value) and "both" in str(e.value)

    # A PEFT adapter repo.
    api.create_repo("alice/peft", token="hf_alice")
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="adapter_config.json", repo_id="alice/peft",
                    token="hf_alice")
    with pytest.raises(hub.AdapterFileNotFoundError, match="PEFT adapter"):
        hub.resolve_adapter_dir("alice/peft")

    # The adapter sits in a subfolder: the error says where, and subfolder= finds it.
    cfg, centroids = make_adapter(tmp_path / "sub", readme=False)
    api.create_repo("alice/multi", token="hf_alice")
    api.upload_folder(folder_path=str(tmp_path / "sub"), path_in_repo="smol-w256", repo_id="alice/multi",
                      token="hf_alice")
    with pytest.raises(hub.AdapterFileNotFoundError, match="'smol-w256'.*subfolder="):
        hub.resolve_adapter_dir("alice/multi")
    path = hub.resolve_adapter_dir("alice/multi", subfolder="smol-w256")
    assert path.endswith(os.path.join("smol-w256"))
    assert_same_adapter(path, cfg, centroids)


def test_revision_not_found(hub_server, tmp_path):
    make_adapter(tmp_path / "ad")
    hub.push_folder_to_hub(tmp_path / "ad", "alice/ad", token="hf_alice", revision="dev")
    with pytest.raises(hub.AdapterRevisionNotFoundError) as e:
        hub.resolve_adapter_dir("alice/ad", revision="v9")
    msg = str(e.value)
    assert "'v9'" in msg and "Branches: dev, main" in msg and "base_model_revision" in msg
    with pytest.raises(hub.AdapterRevisionNotFoundError):
        hub.resolve_adapter_dir("alice/ad", revision="0" * 40)


def test_offline_with_nothing_cached(hub_server, monkeypatch, tmp_path):
    make_adapter(tmp_path / "ad")
    hub.push_folder_to_hub(tmp_path / "ad", "alice/ad", token="hf_alice")
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    n = len(hub_server.requests)
    with pytest.raises(hub.AdapterNotCachedError) as e:
        hub.resolve_adapter_dir("alice/ad")
    assert "HF_HUB_OFFLINE=0" in str(e.value) and "focus-flex pull alice/ad" in str(e.value)
    assert C.HF_HUB_CACHE in str(e.value)
    assert len(hub_server.requests) == n  # offline means no request at all
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    with pytest.raises(hub.AdapterNotCachedError, match="local_files_only=True"):
        hub.resolve_adapter_dir("alice/ad", local_files_only=True)
    # Server gone, nothing cached: a connection problem, said as such. (huggingface_hub retries a refused
    # connection with exponential backoff, ~15 s: skip the waiting, keep the retries.)
    sleeps = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    hub_server.stop()
    with pytest.raises(hub.AdapterNotCachedError, match="no connection.*HF_ENDPOINT"):
        hub.resolve_adapter_dir("alice/ad")
    assert sleeps  # the client did retry


def test_partial_snapshot(hub_server, monkeypatch, tmp_path):
    cfg, centroids = make_adapter(tmp_path / "ad")
    sha = commit_sha(hub.push_folder_to_hub(tmp_path / "ad", "alice/ad", token="hf_alice"))
    # An interrupted download: only the config made it into the cache.
    huggingface_hub.hf_hub_download("alice/ad", CONFIG_NAME)
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.IncompleteAdapterError) as e:
        hub.resolve_adapter_dir("alice/ad")
    msg = str(e.value)
    assert f"snapshots{os.sep}{sha}" in msg and f"lacks {WEIGHTS_NAME}" in msg and "partial download" in msg
    assert "Delete" in msg
    # Only the weights cached (the other order) is detected too.
    snap = os.path.join(C.HF_HUB_CACHE, "models--alice--ad", "snapshots", sha)
    os.rename(os.path.join(snap, CONFIG_NAME), str(tmp_path / "moved"))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    huggingface_hub.hf_hub_download("alice/ad", WEIGHTS_NAME)
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.IncompleteAdapterError, match=f"lacks {CONFIG_NAME}"):
        hub.resolve_adapter_dir("alice/ad", revision=sha)
    # Back online, the missing file is fetched.
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    assert_same_adapter(hub.resolve_adapter_dir("alice/ad"), cfg, centroids)


def test_offline_from_cache_after_server_stopped(hub_server, monkeypatch, tmp_path):
    cfg1, c1 = make_adapter(tmp_path / "v1", seed=1)
    cfg2, c2 = make_adapter(tmp_path / "v2", seed=2)
    sha1 = commit_sha(hub.push_folder_to_hub(tmp_path / "v1", "alice/ad", token="hf_alice"))
    hub.push_folder_to_hub(tmp_path / "v2", "alice/ad", token="hf_alice", revision="dev")
    main = hub.resolve_adapter_dir("alice/ad")
    dev = hub.resolve_adapter_dir("alice/ad", revision="dev")
    hub_server.stop()
    # No connection: huggingface_hub falls back to the cached refs.
    assert hub.resolve_adapter_dir("alice/ad") == main
    # Explicit offline mode.
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    assert hub.resolve_adapter_dir("alice/ad") == main
    assert hub.resolve_adapter_dir("alice/ad", revision="dev") == dev
    assert hub.resolve_adapter_dir("alice/ad", revision=sha1) == main
    assert_same_adapter(main, cfg1, c1)
    assert_same_adapter(dev, cfg2, c2)
    with pytest.raises(hub.AdapterNotCachedError):
        hub.resolve_adapter_dir("alice/ad", revision="other-branch")


def test_env_variables_in_a_fresh_process(hub_server, tmp_path):
    """HF_ENDPOINT / HF_HUB_OFFLINE / HF_TOKEN as users set them: read by huggingface_hub at import time."""
    cfg, centroids = make_adapter(tmp_path / "ad", readme=False)
    env = {**os.environ, "HF_ENDPOINT": hub_server.url, "HF_HUB_CACHE": str(tmp_path / "proc_cache"),
           "HF_HOME": str(tmp_path / "proc_home"), "HF_TOKEN": "hf_alice",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

    def run(*args, **extra):
        return subprocess.run([sys.executable, "-m", "focus_flex.hub", *map(str, args)], env={**env, **extra},
                              capture_output=True, text=True, timeout=60)

    push = run("push", tmp_path / "ad", "alice/proc", "--private")
    assert push.returncode == 0, push.stderr
    sha = commit_sha(push.stdout.strip().splitlines()[-1])
    assert "generated model card" in push.stdout and not (tmp_path / "ad" / "README.md").exists()
    assert hub_server.hub.repos["alice/proc"].private

    pull = run("pull", "alice/proc")
    assert pull.returncode == 0, pull.stderr
    assert f"commit: {sha}" in pull.stdout and '"num_groups": 4' in pull.stdout
    path = pull.stdout.split("adapter: ")[1].splitlines()[0]
    assert_same_adapter(path, cfg, centroids)

    hub_server.stop()
    offline = run("pull", "alice/proc", HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert f"adapter: {path}" in offline.stdout
    missing = run("pull", "alice/other", HF_HUB_OFFLINE="1")
    assert missing.returncode == 1 and "HF_HUB_OFFLINE=0" in missing.stderr


# ---- CLI ----------------------------------------------------------------------------------------
def test_cli_push_validates_uploads_card_and_pull(hub_server, tmp_path, capsys):
    d = tmp_path / "ad"
    cfg, centroids = make_adapter(d, readme=False)
    assert cli("push", d, "alice/cli-ad", "--token", "hf_alice", "--revision", "exp",
               "--message", "first") == 0
    out = capsys.readouterr().out
    assert "generated model card" in out
    url = out.strip().splitlines()[-1]
    sha = commit_sha(url)
    assert not (d / "README.md").exists()  # the card is uploaded, not written into the folder
    commit = hub_server.hub.repos["alice/cli-ad"].commits[sha]
    card = commit.files["README.md"].decode()
    assert card.startswith("---\nlibrary_name: focus_flex\n") and 'from_pretrained("alice/cli-ad")' in card
    assert commit.message == "first" and hub_server.hub.repos["alice/cli-ad"].refs["exp"] == sha

    # A card written before the repo id was known (retrofit) gets it filled in, in the uploaded copy only.
    (d / "README.md").write_text(hub.model_card(cfg.to_dict(), repo_id=None))
    assert cli("push", d, "alice/cli-ad", "--token", "hf_alice", "--revision", "exp") == 0
    sha = commit_sha(capsys.readouterr().out.strip().splitlines()[-1])
    card = hub_server.hub.repos["alice/cli-ad"].commits[sha].files["README.md"].decode()
    assert hub.REPO_PLACEHOLDER not in card and 'from_pretrained("alice/cli-ad")' in card
    assert hub.REPO_PLACEHOLDER in (d / "README.md").read_text()

    assert cli("pull", "alice/cli-ad", "--revision", "exp", "--local-dir", tmp_path / "copy") == 0
    out = capsys.readouterr().out
    assert f"adapter: {tmp_path / 'copy'}\ncommit: {sha}\n" in out
    printed = json.loads(out[out.index("{"):])
    assert FocusConfig.from_dict(printed) == cfg
    assert_same_adapter(tmp_path / "copy", cfg, centroids)

    assert cli("pull", "alice/cli-ad") == 1  # main has no adapter
    assert "has no 'focus_config.json'" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["no_weights", "bad_json", "bad_config", "truncated", "not_safetensors"])
def test_cli_push_refuses_broken_folders(hub_server, tmp_path, capsys, damage):
    d = tmp_path / "ad"
    make_adapter(d)
    w = d / WEIGHTS_NAME
    if damage == "no_weights":
        w.unlink()
    elif damage == "bad_json":
        (d / CONFIG_NAME).write_text("{not json")
    elif damage == "bad_config":
        (d / CONFIG_NAME).write_text(json.dumps({"num_groups": 0}))
    elif damage == "truncated":
        w.write_bytes(w.read_bytes()[:-10])
    else:
        w.write_bytes(b"\x00" * 4)
    n = len(hub_server.requests)
    assert cli("push", d, "alice/ad", "--token", "hf_alice") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert {"no_weights": WEIGHTS_NAME, "bad_json": "not valid JSON", "bad_config": "num_groups",
            "truncated": "truncated", "not_safetensors": "not a safetensors file"}[damage] in err
    assert len(hub_server.requests) == n  # nothing was sent


def test_push_needs_a_write_token(hub_server, tmp_path):
    make_adapter(tmp_path / "ad")
    with pytest.raises(hub.HubAuthError, match="needs a write token.*hf auth login"):
        hub.push_folder_to_hub(tmp_path / "ad", "alice/ad")
    assert not hub_server.requests
    with pytest.raises(hub.HubAuthError, match="no write access to 'alice/ad'"):
        hub.push_folder_to_hub(tmp_path / "ad", "alice/ad", token="hf_bob")
    with pytest.raises(hub.HubAuthError, match="invalid or expired"):
        hub.push_folder_to_hub(tmp_path / "ad", "alice/ad", token="hf_wrong")
    with pytest.raises(ValueError, match="commit sha"):
        hub.push_folder_to_hub(tmp_path / "ad", "alice/ad", token="hf_alice", revision="a" * 40)
    assert "alice/ad" not in hub_server.hub.repos


def folder_hashes(folder):
    """Relative path -> sha256 of every file under ``folder`` (hidden ones too)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in pathlib.Path(folder).rglob("*") if p.is_file()}


@pytest.mark.parametrize("readme", [True, False], ids=["card", "no-card"])
@pytest.mark.parametrize("args,message", [
    (["bad repo id!!", "--token", "hf_alice"], "'bad repo id!!' is not a valid Hub repo id: use 'namespace/name'"),
    (["alice/ad"], "Pushing to the Hub needs a write token"),  # no --token, no HF_TOKEN, no login
], ids=["bad-repo-id", "no-token"])
def test_failed_push_leaves_the_folder_untouched(hub_server, tmp_path, capsys, readme, args, message):
    d = tmp_path / "ad"
    make_adapter(d, readme=readme)  # a card with the repo-id placeholder, as retrofit writes it, or none
    before = folder_hashes(d)
    assert cli("push", d, *args) == 1
    assert folder_hashes(d) == before
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and "Traceback" not in err
    assert not hub_server.requests and not hub_server.hub.repos
    # The Python API checks the same, before anything else.
    with pytest.raises((ValueError, hub.HubAuthError), match=re.escape(message)):
        hub.push_folder_to_hub(d, args[0], token=args[2] if len(args) > 2 else None)
    assert folder_hashes(d) == before and not hub_server.requests


def test_one_folder_pushed_to_two_repos(hub_server, tmp_path, capsys):
    d = tmp_path / "ad"
    make_adapter(d)
    local = (d / "README.md").read_bytes()
    assert hub.REPO_PLACEHOLDER.encode() in local
    before = folder_hashes(d)
    assert cli("push", d, "alice/one", "--token", "hf_alice") == 0
    assert cli("push", d, "bob/two", "--token", "hf_bob") == 0
    hub.push_folder_to_hub(d, "alice/three", token="hf_alice")
    capsys.readouterr()
    for repo in ("alice/one", "bob/two", "alice/three"):
        with open(huggingface_hub.hf_hub_download(repo, "README.md"), "rb") as f:
            card = f.read()
        assert card == local.replace(hub.REPO_PLACEHOLDER.encode(), repo.encode())
        assert f'FocusAdapter.from_pretrained("{repo}")'.encode() in card
    assert folder_hashes(d) == before  # the local card keeps its placeholder

    # No card in the folder: each repo gets a generated one naming it, and none is written locally.
    (d / "README.md").unlink()
    for repo in ("alice/four", "alice/five"):
        assert cli("push", d, repo, "--token", "hf_alice") == 0
        with open(huggingface_hub.hf_hub_download(repo, "README.md"), encoding="utf-8") as f:
            card = f.read()
        assert f'FocusAdapter.from_pretrained("{repo}")' in card and hub.REPO_PLACEHOLDER not in card
    assert not (d / "README.md").exists()


def test_push_without_connection_is_a_clear_error(hub_server, tmp_path, capsys, monkeypatch):
    from focus_flex.cli import main

    d = tmp_path / "ad"
    make_adapter(d)
    before = folder_hashes(d)
    monkeypatch.setattr(time, "sleep", lambda s: None)  # in case the client retries with backoff
    hub_server.stop()
    assert main(["push", str(d), "org/tiny", "--token", "hf_alice"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Cannot push to 'org/tiny': the Hub at " + hub_server.url + " cannot be reached")
    assert "HF_ENDPOINT" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert folder_hashes(d) == before
    with pytest.raises(hub.HubError, match="cannot be reached"):
        hub.push_folder_to_hub(d, "org/tiny", token="hf_alice")


# ---- local folders, model card, base model check ------------------------------------------------
def test_local_directory_is_not_a_repo_id(tmp_path, monkeypatch):
    # No server at all: a local folder never touches the network, even if its name looks like a repo id.
    monkeypatch.chdir(tmp_path)
    cfg, centroids = make_adapter(tmp_path / "alice" / "ad")
    assert hub.resolve_adapter_dir("alice/ad") == str(tmp_path / "alice" / "ad")
    make_adapter(tmp_path / "multi" / "v1")
    assert hub.resolve_adapter_dir(tmp_path / "multi", subfolder="v1") == str(tmp_path / "multi" / "v1")
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="lacks focus_config.json, focus_adapter.safetensors.*PEFT"):
        hub.resolve_adapter_dir(tmp_path / "peft")


def _front_matter(card):
    m = re.match(r"^---\n(.*?)\n---\n", card, re.S)
    assert m, card[:200]
    return yaml.safe_load(m.group(1))


def test_model_card():
    cfg = FocusConfig(num_groups=16, layers=[0, 1, 2], num_layers=30, num_kv_heads=3, head_dim=64,
                      base_model=BASE, model_type="llama", base_model_revision="r1").to_dict()
    card = hub.model_card(cfg, repo_id="alice/smol-focus",
                          results={"perplexity (full)": 17.1, "perplexity": 17.4},
                          results_markdown="Measured on 4096-token windows.", command="focus-flex train ...")
    meta = _front_matter(card)
    assert meta["library_name"] == "focus_flex" and meta["base_model"] == BASE
    assert meta["license"] == "apache-2.0" and meta["base_model_relation"] == "adapter"
    assert meta["tags"][:3] == ["focus-flex", "focus-attention", "sparse-attention"]
    assert "llama" in meta["tags"]
    body = card.split("---", 2)[2]
    assert "Focus" in body and "frozen" in body and "centroids" in body
    assert "| `num_groups` | 16 |" in card and "| `layers` | `[0, 1, 2]` |" in card
    assert "| `base_model_revision` | r1 |" in card
    assert f"{3 * 3 * 16 * 64:,} parameters" in card
    assert "## Results" in card and "| perplexity | 17.4 |" in card
    assert "Measured on 4096-token windows." in card
    assert "focus-flex train ..." in card
    assert "from focus_flex import FocusAdapter" in card
    assert 'adapter = FocusAdapter.from_pretrained("alice/smol-focus")' in card
    assert "model = adapter.load_model()" in card
    assert "{" not in card.replace("{}", "")  # every placeholder filled

    gemma = hub.model_card({**cfg, "base_model": "google/gemma-3-270m", "model_type": "gemma3_text"},
                           repo_id=None)
    assert _front_matter(gemma)["license"] == "gemma"
    other = hub.model_card({**cfg, "base_model": "/models/local-copy", "model_type": "gpt2", "layers": None},
                           repo_id="a/b")
    meta = _front_matter(other)
    assert "license" not in meta and "base_model" not in meta  # unknown licence, local path: not Hub metadata
    assert "`/models/local-copy`" in other and "## Results" not in other
    assert "| `layers` | every full-attention layer |" in other
    # Results recorded in the config's free-form `extra` are shown when none are passed.
    rec = hub.model_card({**cfg, "extra": {"results": {"ppl": 9.5}, "steps": 100}}, repo_id="a/b")
    assert "| ppl | 9.5 |" in rec and '"steps": 100' in rec
    trained = hub.model_card({**cfg, "extra": {"training": {"objective": "distill", "steps": 24}}}, repo_id="a/b")
    assert "| `objective` | distill |" in trained and "| `extra` |" not in trained
    # How it was made is shown once: under "How it was made", not again in the config table.
    made = {**cfg, "extra": {"trained_with": "focus-flex retrofit --steps 24", "init_from": "runs/a"}}
    card = hub.model_card(made, repo_id="a/b", command="focus-flex retrofit --steps 24\n# then evaluated with:\nx")
    assert card.count("focus-flex retrofit --steps 24") == 1 and '"init_from": "runs/a"' in card
    assert "--steps 24" in hub.model_card(made, repo_id="a/b")  # no command: the table is where it shows
    exact = hub.model_card(cfg, repo_id="a/b", tensor_shapes={"centroids": [3, 3, 16, 64]})
    assert "`centroids` [3, 3, 16, 64]" in exact


def test_check_base_model(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hub.check_base_model(BASE, BASE.lower() + "/")
        hub.check_base_model(None, BASE)
        hub.check_base_model(BASE, None)
        hub.check_base_model("model", str(tmp_path / "model"))  # one local folder, relative and absolute
    with pytest.warns(hub.BaseModelMismatchWarning) as rec:
        hub.check_base_model(BASE, "google/gemma-3-270m")
    msg = str(rec[0].message)
    assert BASE in msg and "google/gemma-3-270m" in msg


def test_model_card_template_is_package_data():
    text = (hub.resources.files("focus_flex") / "templates" / "model_card.md").read_text()
    assert "{metadata}" in text and "{repo_id}" in text


# ---- through FocusAdapter -----------------------------------------------------------------------
def tiny_llama(name, num_key_value_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=num_key_value_heads,
                         max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    model.config._name_or_path = model.name_or_path = name  # as from_pretrained(name) sets them
    return model.eval()


def test_focus_adapter_push_to_hub_and_from_pretrained(hub_server, tmp_path):
    from focus_flex.adapter import FocusAdapter

    model = tiny_llama("org/tiny-llama")
    config = FocusConfig(num_groups=4, extra={"results": {"ppl": 12.5}})
    adapter = FocusAdapter.for_model(model, config, seed=3)
    assert adapter.config.base_model == "org/tiny-llama"
    url1 = adapter.push_to_hub("alice/tiny-focus", token="hf_alice", private=True)
    sha1 = commit_sha(url1)
    card = hub_server.hub.repos["alice/tiny-focus"].commits[sha1].files["README.md"].decode()
    assert _front_matter(card)["base_model"] == "org/tiny-llama" and "| ppl | 12.5 |" in card
    assert 'FocusAdapter.from_pretrained("alice/tiny-focus")' in card

    loaded = FocusAdapter.from_pretrained("alice/tiny-focus", token="hf_alice")
    assert loaded.config == adapter.config
    assert torch.equal(loaded.centroids, adapter.centroids)  # bit-exact

    # A second version on a branch; the first stays reachable by its commit sha.
    with torch.no_grad():
        adapter.centroids.mul_(-1)
    sha2 = commit_sha(adapter.push_to_hub("alice/tiny-focus", token="hf_alice", revision="v2",
                                          commit_message="flip"))
    v2 = FocusAdapter.from_pretrained("alice/tiny-focus", token="hf_alice", revision="v2")
    v1 = FocusAdapter.from_pretrained("alice/tiny-focus", token="hf_alice", revision=sha1)
    assert torch.equal(v2.centroids, adapter.centroids) and torch.equal(v1.centroids, -adapter.centroids)
    assert hub_server.hub.repos["alice/tiny-focus"].commits[sha2].message == "flip"

    # Private, no token. (With the adapter already in the cache, huggingface_hub would fall back to the cached
    # copy after the 401, as it does for any failed lookup: hence a fresh cache here.)
    with pytest.raises(hub.AdapterRepoNotFoundError, match="hf auth login"):
        FocusAdapter.from_pretrained("alice/tiny-focus", cache_dir=tmp_path / "fresh")
    with pytest.raises(hub.AdapterRevisionNotFoundError):
        FocusAdapter.from_pretrained("alice/tiny-focus", token="hf_alice", revision="v3")


def test_focus_config_from_pretrained_takes_what_the_adapter_takes(hub_server, monkeypatch, tmp_path):
    """FocusConfig.from_pretrained: a local folder or a Hub repo id (revision, subfolder, token, cache, offline),
    with the errors of FocusAdapter.from_pretrained; from the Hub it fetches the config alone."""
    cfg1, _ = make_adapter(tmp_path / "v1", seed=1)
    sha1 = commit_sha(hub.push_folder_to_hub(tmp_path / "v1", "alice/ad", token="hf_alice"))
    cfg2, _ = make_adapter(tmp_path / "v2", seed=2)
    cfg2.window = 512
    cfg2.save_pretrained(tmp_path / "v2")
    hub.push_folder_to_hub(tmp_path / "v2", "alice/ad", token="hf_alice", revision="dev")

    snapshot = os.path.join(C.HF_HUB_CACHE, "models--alice--ad", "snapshots", sha1)
    assert FocusConfig.from_pretrained("alice/ad") == cfg1
    assert os.listdir(snapshot) == [CONFIG_NAME]  # the centroids were not downloaded
    assert FocusConfig.from_pretrained("alice/ad", revision="dev") == cfg2
    assert FocusConfig.from_pretrained("alice/ad", revision=sha1, local_files_only=True) == cfg1
    assert FocusConfig.from_pretrained(tmp_path / "v2") == cfg2  # a local folder, as before

    api = huggingface_hub.HfApi()
    api.create_repo("alice/multi", token="hf_alice", private=True)
    api.upload_folder(folder_path=str(tmp_path / "v1"), path_in_repo="smol-w256", repo_id="alice/multi",
                      token="hf_alice")
    assert FocusConfig.from_pretrained("alice/multi", subfolder="smol-w256", token="hf_alice") == cfg1
    with pytest.raises(hub.AdapterFileNotFoundError, match="'smol-w256'.*subfolder="):
        FocusConfig.from_pretrained("alice/multi", token="hf_alice")
    with pytest.raises(hub.AdapterRepoNotFoundError, match="hf auth login"):
        FocusConfig.from_pretrained("alice/multi", subfolder="smol-w256", cache_dir=tmp_path / "fresh")
    with pytest.raises(hub.AdapterRepoNotFoundError, match="'alice/nothing-here' was not found"):
        FocusConfig.from_pretrained("alice/nothing-here")
    with pytest.raises(hub.AdapterRepoNotFoundError, match="neither an existing local directory"):
        FocusConfig.from_pretrained(tmp_path / "no" / "such" / "folder")
    with pytest.raises(hub.AdapterRevisionNotFoundError, match="Branches: dev, main"):
        FocusConfig.from_pretrained("alice/ad", revision="v9")
    with pytest.raises(ValueError, match="local folder, which has no revisions"):
        FocusConfig.from_pretrained(tmp_path / "v1", revision="dev")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"lacks {CONFIG_NAME}"):
        FocusConfig.from_pretrained(tmp_path / "empty")
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    assert FocusConfig.from_pretrained("alice/ad", revision="dev") == cfg2  # from the cache
    with pytest.raises(hub.AdapterNotCachedError, match="HF_HUB_OFFLINE=0"):
        FocusConfig.from_pretrained("alice/other")


def test_focus_adapter_for_another_base_model(hub_server, tmp_path):
    from focus_flex.adapter import FocusAdapter

    adapter = FocusAdapter.for_model(tiny_llama("org/tiny-llama"), FocusConfig(num_groups=4))
    adapter.push_to_hub("alice/tiny-focus", token="hf_alice")
    loaded = FocusAdapter.from_pretrained("alice/tiny-focus")

    # Same shapes, other name: attached, with a warning naming both models.
    other = tiny_llama("org/tiny-llama-copy")
    with pytest.warns(hub.BaseModelMismatchWarning) as rec:
        loaded.attach(other)
    assert "org/tiny-llama" in str(rec[0].message) and "org/tiny-llama-copy" in str(rec[0].message)
    loaded.detach(other)
    # Same name (case-insensitive): no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", hub.BaseModelMismatchWarning)
        same = tiny_llama("ORG/tiny-llama")
        loaded.attach(same)
        loaded.detach(same)
    # Other shapes: refused.
    with pytest.raises(ValueError, match="does not fit"):
        loaded.attach(tiny_llama("org/tiny-llama-mqa", num_key_value_heads=1))


@pytest.mark.parametrize("name,flags,center,sinks,tail,wide,evaluated", [
    ("smollm2-135m-instruct-focus", ("--dense-tail 64", "--dense-decode", "--init-from", "--balance-weight 0.03"),
     list(range(15, 30)), 4, 48, [[0, 32, 3], [2, 32, 3], [6, 32, 3]],
     {"full", "focus", "soft", "window", "random"}),
    ("smollm2-135m-instruct-focus-retrieval", ("--center", "--sinks 64"), True, 64, 0, [],
     {"full", "focus", "window", "random"})])
def test_published_adapters_are_ready_to_push_repos(name, flags, center, sinks, tail, wide, evaluated):
    """hub/: the adapters `focus-flex retrofit` trained (the default one centers the upper half of the layers, its
    generation steps and its prompt's last queries attend every token (64 in training, 48 as published), and its lower
    half was fine-tuned from that recipe's adapter with the balance weight at 0.03; the retrieval one centers every
    layer, with 64 sinks), each with its card: perplexity, then passkey retrieval with its heatmaps, measured as
    published."""
    folder = os.path.join(os.path.dirname(__file__), os.pardir, "hub", name)
    config, table = hub.validate_adapter_folder(folder)
    adapter = FocusAdapter.from_pretrained(folder)
    assert config.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and config.model_type == "llama"
    d = DEFAULT_FOCUS  # made by `focus-flex retrofit` with its defaults, but for the flags
    assert (config.num_groups, config.query_top_k, config.key_top_k) == (d.num_groups, d.query_top_k, d.key_top_k)
    assert config.center == center and config.sink_tokens == sinks and config.dense_tail == tail
    assert config.layer_top_k == wide  # the default's layers 0, 2 and 6: queries in 32 groups, keys in 3 (passkey.md)
    assert all(flag in config.extra["trained_with"] for flag in flags)
    # calibrated means of the centered layers, saved with the centroids (zeros for the others)
    assert table["key_means"]["shape"] == [30, 3, 64]
    assert [bool(adapter.key_means[i].any()) for i in range(30)] == [config.centers(i) for i in range(30)]
    assert list(adapter.centroids.shape) == table["centroids"]["shape"] == [30, 3, d.num_groups, 64]
    assert torch.allclose(adapter.centroids.norm(dim=-1), torch.ones(()), atol=1e-4)  # trained, unit-norm
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    meta = _front_matter(card)
    assert meta["library_name"] == "focus_flex" and meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "focus-flex retrofit" in card and "perplexity_vs_density.png" in card
    assert card.index("perplexity_vs_density.png") < card.index("## Long-range retrieval (passkey)")
    passkey = json.load(open(os.path.join(folder, "passkey.json"), encoding="utf-8"))
    # Both decode densely; the cards' retrieval tables were measured with the published settings.
    assert config.dense_decode is passkey["focus_config"]["dense_decode"] is True
    assert passkey["focus_config"].get("dense_tail", 0) == tail
    assert passkey["focus_config"].get("layer_top_k", []) == wide
    passkey = passkey["results"]
    modes = {r["mode"] for r in passkey}
    assert {r["length"] for r in passkey} == {1024, 2048, 4096, 8192} and {"full", "focus"} <= modes
    for mode in modes:
        assert f"(passkey_{mode}.png)" in card and os.path.isfile(os.path.join(folder, f"passkey_{mode}.png"))
    results = json.load(open(os.path.join(folder, "results.json"), encoding="utf-8"))
    modes = {r["mode"]: r for r in results["results"]}
    assert set(modes) == evaluated  # the modes its retrofit command evaluated
    assert results["focus_config"].get("layer_top_k", []) == wide
    assert modes["focus"]["density"] <= 0.25 and config.extra["results"]["focus"]["perplexity"] == pytest.approx(
        modes["focus"]["perplexity"], rel=1e-3)
    for baseline in ("window", "random"):  # equal-cost baselines: matched to Focus's density, tail included
        assert modes[baseline]["density"] == pytest.approx(modes["focus"]["density"], abs=0.005)
    assert os.path.isfile(os.path.join(folder, "perplexity_vs_density.png"))
