"""Real HTTP servers for the storage tests.

* :class:`S3Server`: moto's standalone S3 server (a real HTTP endpoint boto3 talks to),
  reached through a :class:`TcpProxy` so a test can take the endpoint down mid-transfer
  (every connection dropped, the port closed) and bring it back on the same port while the
  server keeps its objects, like an S3 service restarting behind its address.
* :class:`HubServer`: a small in-memory implementation of the subset of the Hugging Face
  Hub HTTP API that ``huggingface_hub`` uses to create repositories, upload
  (preupload + commit with inline base64 content), list trees and download files. It is a
  protocol test double, not the Hub: it stores only "regular" (non-LFS, non-Xet) files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import time
import uuid
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from werkzeug.routing import Map, Rule
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TcpProxy:
    """Forwards connections on 127.0.0.1:``port`` to a backend port.

    :meth:`stop` closes the listening socket and every open connection, so clients see
    resets and refused connections; :meth:`start` listens again on the same port.
    :meth:`cut_after` stops the proxy by itself once that many more request bytes passed;
    :attr:`bytes_forwarded` counts all request bytes.
    """

    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cut_at: int | None = None
        self._sent = 0
        self.bytes_forwarded = 0
        self.cut = threading.Event()

    def start(self) -> None:
        """Listen (again) on :attr:`port`."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for _ in range(50):
            try:
                listener.bind(("127.0.0.1", self.port))
                break
            except OSError:
                time.sleep(0.05)
        listener.listen(64)
        self._listener = listener
        self.cut.clear()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Close the port and drop every connection."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = list(self._sockets), set()
            self._cut_at = None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.cut.set()

    def cut_after(self, nbytes: int) -> None:
        """Stop once ``nbytes`` more bytes of requests have been forwarded."""
        with self._lock:
            self._sent = 0
            self._cut_at = nbytes

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.backend_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, dest: socket.socket, request: bool) -> None:
        try:
            while data := source.recv(65536):
                dest.sendall(data)
                if request:
                    with self._lock:
                        self._sent += len(data)
                        self.bytes_forwarded += len(data)
                        trip = self._cut_at is not None and self._sent >= self._cut_at
                    if trip:
                        self.stop()
                        return
        except OSError:
            pass
        finally:
            for sock in (source, dest):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class S3Server:
    """moto's S3 server on a free port behind a :class:`TcpProxy`."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.backend_port = free_port()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.backend_port,
                                        verbose=False)
        self.proxy = TcpProxy(self.backend_port)

    @property
    def endpoint_url(self) -> str:
        """The URL clients under test use (through the proxy)."""
        return f"http://127.0.0.1:{self.proxy.port}"

    def __enter__(self) -> S3Server:
        self._moto.start()
        self.proxy.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proxy.stop()
        self._moto.stop()

    def direct_client(self) -> Any:
        """A boto3 client talking to moto directly (unaffected by proxy cuts)."""
        import boto3

        return boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{self.backend_port}", region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )


@dataclass
class Bucket:
    """A fresh bucket on the test server."""

    server: S3Server
    name: str

    @property
    def proxy(self) -> TcpProxy:
        """The proxy in front of the server."""
        return self.server.proxy

    def client(self) -> Any:
        """A boto3 client talking to the server directly."""
        return self.server.direct_client()


def use_server(server: S3Server, monkeypatch: Any) -> Bucket:
    """Point the standard AWS environment at ``server`` and create a fresh bucket."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # the tests exercise reasonctl's own retries; botocore's request retries (legacy mode in
    # older releases: up to a minute of backoff against a closed port) stay short
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    bucket = Bucket(server, f"test-{uuid.uuid4().hex[:12]}")
    bucket.client().create_bucket(Bucket=bucket.name)
    return bucket


# --- Hugging Face Hub API subset -----------------------------------------------------------


def git_blob_sha(content: bytes) -> str:
    """The git object id of a blob, as the Hub reports for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


@dataclass
class HubRepo:
    """One repository: its branches (name -> commit) and file trees per commit."""

    repo_id: str
    repo_type: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    trees: dict[str, dict[str, bytes]] = field(default_factory=dict)
    commits: list[dict[str, Any]] = field(default_factory=list)

    def resolve(self, revision: str) -> str | None:
        """Commit id of a branch name or commit id."""
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.trees else None


class HubServer:
    """An in-memory Hub API on 127.0.0.1 (see the module docstring for its scope).

    ``token`` is the only accepted bearer token; requests without it get 401, so a test
    also checks that the client sends the token from ``HF_TOKEN``. ``requests`` records
    ``(method, path)`` of every call.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self.repos: dict[tuple[str, str], HubRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail_commits = 0
        self._lock = threading.Lock()
        self.port = free_port()
        t = "<any(models,datasets,spaces):rtype>"
        self.url_map = Map([
            Rule("/api/repos/create", methods=["POST"], endpoint="create"),
            Rule(f"/api/{t}/<ns>/<name>", methods=["GET"], endpoint="info"),
            Rule(f"/api/{t}/<ns>/<name>/revision/<path:rev>", methods=["GET"], endpoint="info"),
            Rule(f"/api/{t}/<ns>/<name>/preupload/<path:rev>", methods=["POST"],
                 endpoint="preupload"),
            Rule(f"/api/{t}/<ns>/<name>/commit/<path:rev>", methods=["POST"], endpoint="commit"),
            Rule(f"/api/{t}/<ns>/<name>/branch/<path:branch>", methods=["POST"],
                 endpoint="branch"),
            Rule(f"/api/{t}/<ns>/<name>/paths-info/<path:rev>", methods=["POST"],
                 endpoint="paths_info"),
            Rule(f"/api/{t}/<ns>/<name>/tree/<rev>", methods=["GET"], endpoint="tree"),
            Rule(f"/api/{t}/<ns>/<name>/tree/<rev>/<path:path>", methods=["GET"],
                 endpoint="tree"),
            Rule("/<ns>/<name>/resolve/<rev>/<path:path>", methods=["GET", "HEAD"],
                 endpoint="resolve", defaults={"rtype": "models"}),
            Rule("/<any(datasets,spaces):rtype>/<ns>/<name>/resolve/<rev>/<path:path>",
                 methods=["GET", "HEAD"], endpoint="resolve"),
        ])
        self._server = make_server("127.0.0.1", self.port, self._wsgi, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """Base URL to use as ``HF_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_id: str, revision: str = "main",
              repo_type: str = "model") -> dict[str, bytes]:
        """The committed files of a repository at ``revision``."""
        repo = self.repos[(f"{repo_type}s", repo_id)]
        commit = repo.resolve(revision)
        return dict(repo.trees[commit]) if commit else {}

    # --- WSGI ---------------------------------------------------------------------------

    def _wsgi(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        self.requests.append((request.method, request.path))
        adapter = self.url_map.bind_to_environ(environ)
        try:
            endpoint, args = adapter.match()
        except Exception:
            response = _error(404, "Not found", "EntryNotFound")
        else:
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                response = _error(401, "Invalid credentials in Authorization header")
            else:
                with self._lock:
                    response = getattr(self, f"_{endpoint}")(request, **args)
        return response(environ, start_response)

    def _repo(self, rtype: str, ns: str, name: str) -> HubRepo | None:
        return self.repos.get((rtype, f"{ns}/{name}"))

    def _create(self, request: Request) -> Response:
        body = request.get_json()
        rtype = f"{body.get('type') or 'model'}s"
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else \
            body["name"]
        if (rtype, repo_id) in self.repos:
            response = _json({"error": "You already created this model repo",
                              "url": f"{self.endpoint}/{repo_id}"}, 409)
            return response
        private = body.get("visibility") == "private" or bool(body.get("private"))
        repo = HubRepo(repo_id, rtype, private)
        commit = uuid.uuid4().hex + "00000000"
        repo.branches["main"] = commit
        repo.trees[commit] = {}
        self.repos[(rtype, repo_id)] = repo
        return _json({"url": f"{self.endpoint}/{repo_id}", "name": repo_id})

    def _info(self, request: Request, rtype: str, ns: str, name: str,
              rev: str = "main") -> Response:
        repo = self._repo(rtype, ns, name)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        commit = repo.resolve(unquote(rev))
        if commit is None:
            return _error(404, "Invalid rev id", "RevisionNotFound")
        return _json({
            "id": repo.repo_id, "modelId": repo.repo_id, "sha": commit,
            "private": repo.private,
            "siblings": [{"rfilename": p} for p in sorted(repo.trees[commit])],
        })

    def _preupload(self, request: Request, rtype: str, ns: str, name: str,
                   rev: str) -> Response:
        repo = self._repo(rtype, ns, name)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        commit = repo.resolve(unquote(rev))
        tree = repo.trees.get(commit or "", {})
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": git_blob_sha(tree[f["path"]]) if f["path"] in tree else None}
            for f in request.get_json()["files"]
        ]
        return _json({"files": files, "commitOid": commit})

    def _commit(self, request: Request, rtype: str, ns: str, name: str, rev: str) -> Response:
        if self.fail_commits > 0:
            self.fail_commits -= 1
            return _error(503, "Service temporarily unavailable")
        repo = self._repo(rtype, ns, name)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        branch = unquote(rev)
        parent = repo.branches.get(branch)
        if parent is None:
            return _error(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        tree = dict(repo.trees[parent])
        header: dict[str, Any] = {}
        for line in request.get_data().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                tree[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in tree:
                    return _error(404, "A file with this name doesn't exist", "EntryNotFound")
                del tree[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                for path in [p for p in tree if p.startswith(prefix)]:
                    del tree[path]
            else:
                return _error(400, f"unsupported commit operation {key!r} (regular files only)")
        commit = hashlib.sha1(f"{parent}{time.time_ns()}".encode(),
                              usedforsecurity=False).hexdigest()
        repo.trees[commit] = tree
        repo.branches[branch] = commit
        repo.commits.append({"oid": commit, "branch": branch, **header})
        return _json({"commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{commit}",
                      "commitOid": commit, "pullRequestUrl": None})

    def _branch(self, request: Request, rtype: str, ns: str, name: str, branch: str) -> Response:
        repo = self._repo(rtype, ns, name)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        branch = unquote(branch)
        if branch in repo.branches:
            return _error(409, "Reference already exists")
        body = request.get_json(silent=True) or {}
        start = repo.resolve(body.get("startingPoint") or "main")
        repo.branches[branch] = start or repo.branches["main"]
        return _json({})

    def _paths_info(self, request: Request, rtype: str, ns: str, name: str,
                    rev: str) -> Response:
        repo = self._repo(rtype, ns, name)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        commit = repo.resolve(unquote(rev))
        if commit is None:
            return _error(404, "Invalid rev id", "RevisionNotFound")
        tree = repo.trees[commit]
        paths = request.form.getlist("paths")
        out = []
        for path in paths:
            path = path.strip("/")
            if path in tree:
                out.append(_file_entry(path, tree[path]))
            elif any(p.startswith(path + "/") for p in tree):
                out.append({"type": "directory", "path": path, "oid": "0" * 40})
        return _json(out)

    def _tree(self, request: Request, rtype: str, ns: str, name: str, rev: str,
              path: str = "") -> Response:
        repo = self._repo(rtype, ns, name)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        commit = repo.resolve(unquote(rev))
        if commit is None:
            return _error(404, "Invalid rev id", "RevisionNotFound")
        tree = repo.trees[commit]
        path = unquote(path).strip("/")
        prefix = f"{path}/" if path else ""
        recursive = request.args.get("recursive", "false").lower() == "true"
        entries: dict[str, dict[str, Any]] = {}
        for file_path, content in sorted(tree.items()):
            if not file_path.startswith(prefix):
                continue
            rest = file_path[len(prefix):].split("/")
            for depth in range(1, len(rest)):
                if depth > 1 and not recursive:
                    break
                folder = prefix + "/".join(rest[:depth])
                entries.setdefault(folder, {"type": "directory", "path": folder, "oid": "0" * 40})
            if recursive or len(rest) == 1:
                entries[file_path] = _file_entry(file_path, content)
        if path and not entries:
            return _error(404, f"{path} does not exist on {rev}", "EntryNotFound")
        return _json(list(entries.values()))

    def _resolve(self, request: Request, rtype: str, ns: str, name: str, rev: str,
                 path: str) -> Response:
        repo = self._repo(rtype, ns, name)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        commit = repo.resolve(unquote(rev))
        if commit is None:
            return _error(404, "Invalid rev id", "RevisionNotFound")
        content = repo.trees[commit].get(unquote(path))
        if content is None:
            return _error(404, "Entry not found", "EntryNotFound")
        response = Response(b"" if request.method == "HEAD" else content,
                            mimetype="application/octet-stream")
        response.headers["X-Repo-Commit"] = commit
        response.headers["ETag"] = f'"{git_blob_sha(content)}"'
        response.headers["Content-Length"] = str(len(content))
        return response


def _file_entry(path: str, content: bytes) -> dict[str, Any]:
    return {"type": "file", "path": path, "size": len(content), "oid": git_blob_sha(content)}


def _json(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload), status=status, mimetype="application/json")


def _error(status: int, message: str, code: str | None = None) -> Response:
    response = _json({"error": message}, status)
    if code:
        response.headers["X-Error-Code"] = code
    response.headers["X-Error-Message"] = message
    return response


__all__ = ["Bucket", "HubServer", "S3Server", "TcpProxy", "free_port", "git_blob_sha", "use_server"]
