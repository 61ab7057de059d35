"""A small, in-memory Hugging Face Hub speaking just enough of the HTTP protocol for `huggingface_hub`.

Test fixture only (no Hub is reachable from these machines): the REAL `huggingface_hub` client is pointed at
it through ``HF_ENDPOINT`` / ``huggingface_hub.constants.ENDPOINT`` and does real HTTP against 127.0.0.1.

What it models, following the Hub's observable behaviour:

- model repos ``namespace/name``, public or private; a repo starts with one commit holding ``.gitattributes``;
- git-like objects: a file's id is its git blob sha1 (what the Hub sends as ``ETag`` for regular files), a
  commit id is the sha1 of its tree, parent and message; branches, ``refs/pr/N`` refs, full-sha lookups;
- tokens map to user names (``Authorization: Bearer <token>``); anonymous reads of a private or missing repo
  get ``401`` + ``X-Error-Code: RepoNotFound``, authenticated ones ``404``; an unknown token gets ``401`` with
  ``X-Error-Message: Invalid credentials in Authorization header``; writes need the namespace owner's token;
- uploads are always ``regular`` (base64 inside the NDJSON commit payload): no LFS, no Xet.

Every request is appended to ``server.requests`` as ``(method, path_template)``; requests it does not know
are recorded in ``server.unhandled`` and answered 404 without an ``X-Error-Code`` (the fixture fails a test
that triggered one, so the list of endpoints the client uses stays known).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    parent: str | None
    message: str
    files: dict[str, bytes]  # path -> content (full tree, not a diff)
    date: float


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # "main", "dev", "refs/pr/1" -> commit sha
    created: float = field(default_factory=time.time)
    n_prs: int = 0


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class FakeHub:
    """The state of the Hub (thread-safe through one lock) and the operations the handler needs."""

    def __init__(self, tokens: dict[str, str] | None = None):
        self.tokens = dict(tokens or {})
        self.repos: dict[str, Repo] = {}
        self.lock = threading.RLock()
        self._counter = 0

    # ---- objects ---------------------------------------------------------------------------------
    def _commit(self, repo: Repo, parent: str | None, files: dict[str, bytes], message: str) -> str:
        self._counter += 1
        tree = "\n".join(f"{p} {git_blob_sha(c)}" for p, c in sorted(files.items()))
        tree_sha = hashlib.sha1(tree.encode()).hexdigest()
        body = f"tree {tree_sha}\nparent {parent}\n#{self._counter}\n\n{message}"
        sha = hashlib.sha1(b"commit %d\0" % len(body) + body.encode()).hexdigest()
        repo.commits[sha] = Commit(sha, parent, message, dict(files), time.time())
        return sha

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        with self.lock:
            repo = Repo(repo_id, private)
            attributes = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
            sha = self._commit(repo, None, {".gitattributes": attributes}, "initial commit")
            repo.refs["main"] = sha
            self.repos[repo_id] = repo
            return repo

    # ---- access ----------------------------------------------------------------------------------
    def user(self, authorization: str | None) -> str | None:
        """The user a request authenticates as; raises 401 for a token the Hub does not know."""
        if not authorization:
            return None
        token = authorization.removeprefix("Bearer ").strip()
        if token not in self.tokens:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        return self.tokens[token]

    def readable(self, repo_id: str, user: str | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and user != repo_id.split("/")[0]):
            # Same answer for "missing" and "private, not yours": the Hub does not leak existence.
            raise HubError(404 if user else 401, "RepoNotFound", "Repository not found")
        return repo

    def writable(self, repo_id: str, user: str | None) -> Repo:
        if user is None:
            raise HubError(401, None, "You must be authenticated to write to a repo (pass a token)")
        repo = self.readable(repo_id, user)
        if user != repo_id.split("/")[0]:
            raise HubError(403, None, f"You don't have the rights to write to {repo_id}")
        return repo

    @staticmethod
    def resolve(repo: Repo, rev: str) -> Commit:
        if rev in repo.refs:
            return repo.commits[repo.refs[rev]]
        if rev.startswith("refs/heads/") and rev[len("refs/heads/"):] in repo.refs:
            return repo.commits[repo.refs[rev[len("refs/heads/"):]]]
        if SHA_RE.match(rev) and rev in repo.commits:
            return repo.commits[rev]
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, fmt, *args):  # keep pytest output clean
        pass

    # ---- plumbing --------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              content_type="application/json", head_only: bool = False, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.send_header("Connection", "close")  # no keep-alive: a stopped server really is gone
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head_only:
            self.wfile.write(body)
        self.close_connection = True

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, e: HubError, head_only: bool = False) -> None:
        headers = {"X-Error-Message": e.message}
        if e.code:
            headers["X-Error-Code"] = e.code
        if e.commit:
            headers["X-Repo-Commit"] = e.commit
        body = b"" if head_only else json.dumps({"error": e.message}).encode()
        self._send(e.status, body, headers, head_only=head_only, length=len(body))

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{self.headers.get('Host') or f'{host}:{port}'}"

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # ---- routing ---------------------------------------------------------------------------------
    ROUTES = [
        ("GET", r"/api/whoami-v2", "whoami"),
        ("GET", r"/api/agent-harnesses", "agent_harnesses"),
        ("POST", r"/api/repos/create", "create_repo"),
        ("POST", r"/api/validate-yaml", "validate_yaml"),
        ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>.+)", "info"),
        ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)", "info"),
        ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
        ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)/refs", "refs"),
        ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>.+)", "preupload"),
        ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>.+)", "commit"),
        ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<branch>.+)", "create_branch"),
        ("HEAD", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
        ("GET", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ]

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        raw_path = url.path  # still %-quoted: a revision like refs%2Fpr%2F1 is one path segment
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        for m, pattern, name in self.ROUTES:
            match = re.fullmatch(pattern, raw_path)
            if m == method and match:
                args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                self.server.requests.append((method, pattern))
                hub = self.server.hub
                try:
                    with hub.lock:
                        user = hub.user(self.headers.get("Authorization"))
                        getattr(self, "h_" + name)(hub, user, query, head_only=(method == "HEAD"), **args)
                except HubError as e:
                    self._error(e, head_only=(method == "HEAD"))
                return
        self.server.unhandled.append((method, self.path))
        if method != "HEAD":
            self._body()
        self._send(404, b"" if method == "HEAD" else b'{"error": "not implemented by the test hub"}',
                   head_only=(method == "HEAD"), length=0 if method == "HEAD" else None)

    # ---- endpoints -------------------------------------------------------------------------------
    def h_whoami(self, hub: FakeHub, user, query, head_only=False):
        if user is None:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        self._json(200, {"type": "user", "id": user, "name": user, "fullname": user, "orgs": [],
                         "auth": {"type": "access_token",
                                  "accessToken": {"displayName": "test", "role": "write"}}})

    def h_agent_harnesses(self, hub: FakeHub, user, query, head_only=False):
        # Fetched once per process by huggingface_hub's user-agent code (AI-agent detection): none here.
        self._json(200, {"standardEnvVars": [], "harnesses": {}})

    def h_create_repo(self, hub: FakeHub, user, query, head_only=False):
        payload = json.loads(self._body() or b"{}")
        if user is None:
            raise HubError(401, None, "You must be authenticated to create a repo (pass a token)")
        if payload.get("type", "model") not in (None, "model"):
            raise HubError(400, None, "the test hub only has model repos")
        namespace = payload.get("organization") or user
        name = payload.get("name", "")
        if namespace != user:
            raise HubError(403, None, "You don't have the rights to create a model under the namespace "
                                      f"{namespace}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise HubError(400, None, f"Invalid repo name {name!r}")
        repo_id = f"{namespace}/{name}"
        url = f"{self.endpoint}/{repo_id}"
        if repo_id in hub.repos:
            self._json(409, {"error": "You already created this model repo", "url": url})
            return
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        hub.create_repo(repo_id, private=private)
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def h_validate_yaml(self, hub: FakeHub, user, query, head_only=False):
        payload = json.loads(self._body() or b"{}")
        content = payload.get("content", "")
        errors = []
        match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        if match:
            try:
                meta = yaml.safe_load(match.group(1))
            except yaml.YAMLError as e:
                meta, errors = None, [{"message": f"YAML is invalid: {e}"}]
            if not errors and not isinstance(meta, dict):
                errors.append({"message": "metadata must be a YAML mapping"})
            elif not errors:
                for key in ("library_name", "license", "pipeline_tag"):
                    if key in meta and not isinstance(meta[key], str):
                        errors.append({"message": f'"{key}" must be a string'})
                if "tags" in meta and not (isinstance(meta["tags"], list)
                                           and all(isinstance(t, str) for t in meta["tags"])):
                    errors.append({"message": '"tags" must be a list of strings'})
                base = meta.get("base_model")
                if base is not None and not all(isinstance(b, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", b)
                                                for b in ([base] if isinstance(base, str) else base)):
                    errors.append({"message": '"base_model" must be a Hub model id (namespace/name)'})
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})

    def h_info(self, hub: FakeHub, user, query, rev="main", repo="", head_only=False):
        r = hub.readable(repo, user)
        c = hub.resolve(r, rev)
        self._json(200, {
            "_id": hashlib.sha1(repo.encode()).hexdigest()[:24], "id": repo, "modelId": repo,
            "author": repo.split("/")[0], "sha": c.sha, "private": r.private, "gated": False,
            "disabled": False,
            "downloads": 0, "likes": 0, "tags": [],
            "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(c.date)),
            "createdAt": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(r.created)),
            "siblings": [{"rfilename": p} for p in sorted(c.files)],
        })

    def h_tree(self, hub: FakeHub, user, query, repo="", rev="main", path="", head_only=False):
        r = hub.readable(repo, user)
        c = hub.resolve(r, rev)
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        recursive = query.get("recursive", "false").lower() in ("1", "true")
        entries, dirs = [], set()
        for p in sorted(c.files):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                d = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and d not in dirs:
                    dirs.add(d)
                    oid = hashlib.sha1(d.encode()).hexdigest()
                    entries.append({"type": "directory", "oid": oid, "size": 0, "path": d})
            if recursive or len(parts) == 1:
                data = c.files[p]
                entries.append({"type": "file", "oid": git_blob_sha(data), "size": len(data), "path": p})
        if prefix and not entries:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}", commit=c.sha)
        self._json(200, entries)

    def h_refs(self, hub: FakeHub, user, query, repo="", head_only=False):
        r = hub.readable(repo, user)
        branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": s}
                    for n, s in sorted(r.refs.items()) if not n.startswith("refs/")]
        out = {"branches": branches, "tags": [], "converts": []}
        if query.get("include_prs", "").lower() in ("1", "true"):
            out["pullRequests"] = [{"name": n[len("refs/pr/"):], "ref": n, "targetCommit": s}
                                   for n, s in sorted(r.refs.items()) if n.startswith("refs/pr/")]
        self._json(200, out)

    def h_resolve(self, hub: FakeHub, user, query, repo="", rev="", path="", head_only=False):
        r = hub.readable(repo, user)
        c = hub.resolve(r, rev)
        if path not in c.files:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}", commit=c.sha)
        data = c.files[path]
        etag = f'"{git_blob_sha(data)}"'
        headers = {"X-Repo-Commit": c.sha, "ETag": etag, "X-Linked-Etag": etag,
                   "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes"}
        status = 200
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m and not head_only:
            start, end = int(m.group(1)), int(m.group(2) or len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        self._send(status, data, headers, content_type="application/octet-stream", head_only=head_only,
                   length=len(data))

    def h_preupload(self, hub: FakeHub, user, query, repo="", rev="", head_only=False):
        payload = json.loads(self._body() or b"{}")
        r = hub.writable(repo, user)
        c = hub.resolve(r, rev)
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                  "oid": git_blob_sha(c.files[f["path"]]) if f["path"] in c.files else None}
                 for f in payload.get("files", [])]
        self._json(200, {"files": files, "commitOid": c.sha})

    def h_commit(self, hub: FakeHub, user, query, repo="", rev="", head_only=False):
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        r = hub.writable(repo, user)
        create_pr = query.get("create_pr") == "1"
        if SHA_RE.match(rev) or (rev not in r.refs and not (create_pr and rev == "main")):
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev} (commits go to a branch)")
        base = hub.resolve(r, rev)
        header = next((x["value"] for x in lines if x.get("key") == "header"), None)
        if header is None or not header.get("summary"):
            raise HubError(400, None, "commit header with a summary is required")
        if header.get("parentCommit") and header["parentCommit"] != base.sha:
            raise HubError(412, None, "A commit has happened since. Please refresh and try again.")
        files = dict(base.files)
        for op in lines:
            key, v = op.get("key"), op.get("value", {})
            if key == "file":
                if v.get("encoding") != "base64":
                    raise HubError(400, None, "the test hub only accepts base64 file contents")
                files[v["path"]] = base64.b64decode(v["content"])
            elif key == "deletedFile":
                if v["path"] not in files:
                    raise HubError(404, "EntryNotFound", "A file with this name doesn't exist")
                del files[v["path"]]
            elif key == "deletedFolder":
                files = {p: d for p, d in files.items() if not p.startswith(v["path"].rstrip("/") + "/")}
            elif key in ("lfsFile", "copyFile"):
                raise HubError(400, None, f"{key} is not supported: the test hub only takes regular uploads")
        message = header["summary"] + ("\n\n" + header["description"] if header.get("description") else "")
        sha = hub._commit(r, base.sha, files, message)
        out = {"success": True, "commitOid": sha, "commitUrl": f"{self.endpoint}/{repo}/commit/{sha}",
               "hookOutput": ""}
        if create_pr:
            r.n_prs += 1
            r.refs[f"refs/pr/{r.n_prs}"] = sha
            out["pullRequestUrl"] = f"{self.endpoint}/{repo}/discussions/{r.n_prs}"
        else:
            r.refs[rev] = sha
        self._json(200, out)

    def h_create_branch(self, hub: FakeHub, user, query, repo="", branch="", head_only=False):
        payload = json.loads(self._body() or b"{}")
        r = hub.writable(repo, user)
        if branch.startswith("refs/") or SHA_RE.match(branch):
            raise HubError(400, None, f"Invalid reference for a branch: {branch}")
        if branch in r.refs:
            raise HubError(409, None, f"Reference refs/heads/{branch} already exists")
        r.refs[branch] = hub.resolve(r, payload.get("startingPoint") or "main").sha
        self._json(200, {})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, hub: FakeHub):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []


class HubServer:
    """Start/stop wrapper. ``url`` goes into HF_ENDPOINT; ``hub`` is the state (inspect or seed it)."""

    def __init__(self, tokens: dict[str, str] | None = None):
        self.hub = FakeHub(tokens)
        self._server = _Server(self.hub)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        self.running = True

    @property
    def requests(self) -> list[tuple[str, str]]:
        return self._server.requests

    @property
    def unhandled(self) -> list[tuple[str, str]]:
        return self._server.unhandled

    def stop(self) -> None:
        if self.running:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self.running = False

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # manual poking: python tests/hub_server.py, then HF_ENDPOINT=<url> ...
    s = HubServer({"hf_test": "alice"})
    print(f"test hub at {s.url} (token hf_test -> user alice); Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        s.stop()
