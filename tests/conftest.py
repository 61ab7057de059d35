import pytest


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    """A fresh in-memory test Hub (tests/hub_server.py) with the REAL huggingface_hub client pointed at it.

    huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE / HF_HUB_CACHE / token paths into
    `huggingface_hub.constants` at import time and looks them up there at call time, so in this process the
    constants are patched; HF_ENDPOINT is also set in the environment for subprocesses. The cache, token files
    and agent registry go to tmp_path, and no ambient token leaks in. Tokens: ``hf_alice`` -> user ``alice``,
    ``hf_bob`` -> user ``bob``. A test fails if the client sent a request the server does not implement.
    """
    import huggingface_hub.constants as C
    from hub_server import HubServer

    server = HubServer({"hf_alice": "alice", "hf_bob": "bob"})
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr(C, "ENDPOINT", server.url)
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(C, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(C, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(C, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored_tokens"))
    monkeypatch.setattr(C, "AGENT_HARNESSES_PATH", str(tmp_path / "hf_home" / "agent_harnesses.json"))
    try:
        yield server
    finally:
        server.stop()
    assert not server.unhandled, f"requests the test hub does not implement: {server.unhandled}"


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Run a test on each implementation of the one-query decode step: the C step (which must build here) and the
    PyTorch ops that replace it where it cannot run (no compiler, GPU tensors, float16)."""
    from focus_flex import native

    if request.param == "native":
        assert native.library() is not None, "the C decode step did not build"
    else:
        monkeypatch.setattr(native, "library", lambda: None)
    return request.param


@pytest.fixture(scope="module")
def smollm2():
    """The embedded SmolLM2-135M-Instruct and its tokenizer (focus_flex.models.load_model)."""
    from focus_flex.models import load_model

    return load_model()
