"""A local stand-in for the Hugging Face Hub file API, for tests (127.0.0.1 only).

It serves the endpoints `huggingface_hub` calls for `model_info` and `snapshot_download`:
repo info at a revision, the recursive tree of a commit, and file HEAD/GET under
`/<repo>/resolve/<commit>/<path>`; it records every request so tests can assert that a
memoized acquire made none.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class StandInRepo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> {path: content}
    refs: dict[str, str]  # branch or tag -> commit sha
    gated: bool = False


@dataclass
class HubStandIn:
    repos: dict[str, StandInRepo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add_folder(self, repo_id: str, commit: str, folder: Path, refs: list[str]) -> None:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")}
        files = {k: v for k, v in files.items() if not (folder / k).is_dir()}
        repo = self.repos.setdefault(repo_id, StandInRepo(commits={}, refs={}))
        repo.commits[commit] = files
        for ref in refs:
            repo.refs[ref] = commit

    def start(self) -> HubStandIn:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                stand_in.requests.append(f"{self.command} {self.path}")
                path = unquote(urlparse(self.path).path)
                status, headers, payload = stand_in.route(path)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def route(self, path: str) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/") :]
            for marker in ("/revision/", "/tree/"):
                if marker in rest:
                    repo_id, revision = rest.split(marker, 1)
                    if marker == "/tree/":
                        revision = revision.split("/", 1)[0]
                    return self._api(repo_id, revision, tree=marker == "/tree/")
            return self._api(rest, "main", tree=False)
        if "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            revision, file_path = rest.split("/", 1)
            return self._file(repo_id, revision, file_path)
        return 404, {}, b"{}"

    def _lookup(self, repo_id: str, revision: str) -> tuple[int, dict, str | None]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return 404, {"X-Error-Code": "RepoNotFound"}, None
        if repo.gated:
            return 403, {"X-Error-Code": "GatedRepo"}, None
        commit = repo.refs.get(revision, revision)
        if commit not in repo.commits:
            return 404, {"X-Error-Code": "RevisionNotFound"}, None
        return 200, {}, commit

    def _api(self, repo_id: str, revision: str, tree: bool) -> tuple[int, dict, bytes]:
        status, headers, commit = self._lookup(repo_id, revision)
        if commit is None:
            return status, headers, json.dumps({"error": headers["X-Error-Code"]}).encode()
        files = self.repos[repo_id].commits[commit]
        if tree:
            entries = [
                {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                for name, data in sorted(files.items())
            ]
            return 200, {"Content-Type": "application/json"}, json.dumps(entries).encode()
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "siblings": [{"rfilename": name} for name in sorted(files)],
        }
        return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()

    def _file(self, repo_id: str, revision: str, file_path: str) -> tuple[int, dict, bytes]:
        status, headers, commit = self._lookup(repo_id, revision)
        if commit is None:
            return status, headers, b""
        data = self.repos[repo_id].commits[commit].get(file_path)
        if data is None:
            return 404, {"X-Error-Code": "EntryNotFound"}, b""
        return (
            200,
            {"X-Repo-Commit": commit, "ETag": f'"{_git_oid(data)}"'},
            data,
        )


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
