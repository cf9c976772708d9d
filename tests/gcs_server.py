"""A local Cloud Storage for tests: gcp-storage-emulator behind a proxy that fills the
emulator's gaps and injects faults, on 127.0.0.1, in a process that stops by itself. The proxy
is the only HTTP server: it hands each request to the emulator's router in the same process.

    python tests/gcs_server.py --data_dir=DIR [--port=0] [--bucket=tx-jax-test]
        [--lifetime=1800] [--parent_pid=PID]      prints "READY <port>", then serves

Clients reach it as real GCS would be reached through a custom endpoint:
STORAGE_EMULATOR_HOST=http://127.0.0.1:<port> (gcsfs, google-cloud-storage) and
TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:<port> (TensorStore, Orbax's arrays); `env(port)`
gives the whole environment, TX_JAX_GCS_BACKOFF included (the clients retry in milliseconds).
The objects live under --data_dir, so the server outlives any client process (kill -9 of a
trainer) and a restarted server sees the same bucket.

Where the emulator falls short of GCS, the proxy does what GCS does (nothing else changes):
- media downloads carry `x-goog-generation` / `x-goog-metageneration` headers (GCS sends
  them; TensorStore reads the generation from them: without, "Malformed StorageGeneration");
- objects.move (`POST .../o/SRC/moveTo/o/DST`, gcsfs's rename) is done as copyTo + delete
  (the emulator answers 501);
- generation preconditions (`ifGenerationMatch` on uploads and deletes, `ifGenerationMatch`
  / `ifGenerationNotMatch` on reads) are checked against the object's generation and answered
  412 / 304 as GCS does (the emulator ignores them; TensorStore's atomic writes rely on them).

Faults (`GET /__faults__?rate=R&codes=429,503&reset=P&delay=S&slow=Q&seed=N&down=0|1`, or
`set_faults(port, ...)`): each request fails with one of `codes` with probability `rate`,
has its connection reset (closed without a reply) with probability `reset`, and is delayed
by up to `delay` seconds with probability `slow` (default 1: every request); `down=1` resets
every connection (the server gone) until `down=0`, and `down_on=TEXT` takes the server down
so at the first request whose URL (unquoted) contains TEXT, that request included.
`GET /__stats__` counts what was forwarded and injected since the server started. The
process exits after `--lifetime` seconds, or as soon as `--parent_pid` is gone.
"""

from __future__ import annotations

import argparse
import email.message
import http.server
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
import urllib.parse
import urllib.request
from collections.abc import Callable

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def env(port: int) -> dict[str, str]:
    """The environment that points gcsfs, google-cloud-storage and TensorStore at the server."""
    url = f"http://127.0.0.1:{port}"
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        # gcsfs probes a bucket's type over gRPC (storage-control), which the emulator does
        # not speak; its plain JSON-API file system is what the probe falls back to anyway.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        # No Google credentials exist here: TensorStore and google-auth must not wait for a
        # metadata server (gcsfs uses anonymous access against an emulator host by itself).
        "GCE_METADATA_HOST": "127.0.0.1:9",
        "GCE_METADATA_ROOT": "127.0.0.1:9",
        "GCE_METADATA_IP": "127.0.0.1:9",
        "NO_GCE_CHECK": "true",
        # The clients' retry waits in milliseconds, not seconds (docs/reliability.md): the
        # faults the proxy injects are still retried and absorbed, and an outage is given up
        # on after about 0.3 s instead of 30.
        "TX_JAX_GCS_BACKOFF": "0.01",
    }


def set_faults(port: int, **faults) -> dict:
    """Change the running proxy's faults (rate, codes, reset, delay, slow, seed, down,
    down_on)."""
    query = urllib.parse.urlencode(
        {k: ",".join(map(str, v)) if isinstance(v, list | tuple) else v for k, v in faults.items()}
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/__faults__?{query}", timeout=10) as r:
        return json.loads(r.read())


def stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/__stats__", timeout=10) as r:
        return json.loads(r.read())


class Started:
    """A server process started by `start`: .port, .env, .stop(), a context manager."""

    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.port, self.env = proc, port, env(port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(data_dir: str, bucket: str = "tx-jax-test", lifetime: float = 1800) -> Started:
    """Start the server in a process of its own (stops with this one, or after `lifetime`);
    what it prints on stderr (errors, the replies that faulted clients never read) goes to
    DATA_DIR/server.log."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "server.log"), "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                f"--data_dir={data_dir}",
                f"--bucket={bucket}",
                f"--lifetime={lifetime}",
                f"--parent_pid={os.getpid()}",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the GCS server did not start: {line!r}")
    return Started(proc, int(line.split()[1]))


# ------------------------------------------------------------------------- the server


class Faults:
    def __init__(self):
        self.lock = threading.Lock()
        self.rate, self.codes, self.reset, self.delay, self.down = 0.0, [429, 503], 0.0, 0.0, False
        self.slow, self.down_on = 1.0, ""
        self.rng = random.Random(0)
        self.counts = {"forwarded": 0, "failed": 0, "reset": 0, "delayed": 0, "refused": 0}

    def update(self, query: dict[str, list[str]]) -> dict:
        with self.lock:
            for key in ("rate", "reset", "delay", "slow"):
                if key in query:
                    setattr(self, key, float(query[key][0]))
            if "codes" in query:
                self.codes = [int(c) for c in query["codes"][0].split(",") if c]
            if "down" in query:
                self.down = query["down"][0] in ("1", "true")
            if "down_on" in query:
                self.down_on = query["down_on"][0]
            if "seed" in query:
                self.rng = random.Random(int(query["seed"][0]))
            return self.state()

    def state(self) -> dict:
        return dict(
            rate=self.rate,
            codes=self.codes,
            reset=self.reset,
            delay=self.delay,
            slow=self.slow,
            down=self.down,
            down_on=self.down_on,
        )

    def draw(self, url: str) -> tuple[str, float, int]:
        """-> (what: 'down' | 'reset' | 'fail' | 'pass', delay seconds, code)."""
        with self.lock:
            if self.down_on and self.down_on in urllib.parse.unquote(url):
                self.down, self.down_on = True, ""
            slow = self.delay and (self.slow >= 1 or self.rng.random() < self.slow)
            delay = self.rng.uniform(0, self.delay) if slow else 0.0
            if self.down:
                self.counts["refused"] += 1
                return "down", 0.0, 0
            u = self.rng.random()
            if u < self.reset:
                self.counts["reset"] += 1
                return "reset", delay, 0
            if u < self.reset + self.rate:
                self.counts["failed"] += 1
                return "fail", delay, self.rng.choice(self.codes)
            self.counts["forwarded"] += 1
            self.counts["delayed"] += delay > 0
            return "pass", delay, 0


def _object_of(path: str) -> tuple[str, str] | None:
    """(bucket, object) of a JSON-API or media object path, else None."""
    for prefix in ("/download/storage/v1/b/", "/storage/v1/b/", "/upload/storage/v1/b/"):
        if path.startswith(prefix):
            rest = path[len(prefix) :]
            bucket, sep, obj = rest.partition("/o/")
            if sep and obj and "/" not in bucket:
                return bucket, urllib.parse.unquote(obj)
    return None


def _upload_name(body: bytes) -> str:
    """The object name in an upload's JSON metadata (multipart's first part, or resumable's)."""
    match = re.search(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body[:65536])
    return json.loads(b'"' + match.group(1) + b'"') if match else ""


class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: a reply is written as headers then body; with Nagle's algorithm the body
    # waits for the client's delayed ACK of the headers (~40 ms a request on Linux), which
    # made a checkpoint save on gs:// take 4 s instead of 1.
    disable_nagle_algorithm = True
    storage = None  # the emulator's Storage and Router, in this process
    router = None
    faults: Faults
    lock = threading.Lock()  # the emulator serves one request at a time

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _call(self, method: str, path: str, body: bytes = b"", headers=None):
        """The emulator's answer (status, headers, body) to a request: its router, called in
        this process, one request at a time (its storage is not thread-safe)."""
        host = self.headers.get("Host", "")  # the URLs it answers with lead back here
        request = _EmulatorRequest(self.storage, method, path, headers or {}, body, host)
        with self.lock:
            self.router(request).handle(method)
        return request.status, request.reply_headers, request.wfile.getvalue()

    def _reply(self, status: int, headers, data: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _json(self, status: int, obj) -> None:
        self._reply(status, [("Content-Type", "application/json")], json.dumps(obj).encode())

    def _metadata(self, bucket: str, obj: str) -> dict | None:
        """The object's metadata (what objects.get answers), read from the emulator's storage
        directly rather than asked for over HTTP (a second request for every download)."""
        with self.lock:
            meta = self.storage.objects.get(bucket, {}).get(obj)
            return dict(meta) if meta else None

    def _handle(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/__faults__":
            return self._json(200, self.faults.update(query))
        if url.path == "/__stats__":
            with self.faults.lock:
                return self._json(200, dict(self.faults.counts))
        what, delay, code = self.faults.draw(self.path)
        if what == "down":
            self.close_connection = True
            return self.connection.shutdown(socket.SHUT_RDWR)
        body = self._body()
        if delay:
            time.sleep(delay)
        if what == "reset":  # the request was read, never answered
            self.close_connection = True
            return self.connection.shutdown(socket.SHUT_RDWR)
        if what == "fail":
            return self._json(code, {"error": {"code": code, "message": "injected by the proxy"}})
        target = _object_of(url.path)
        if method == "POST" and target and "/moveTo/o/" in target[1]:
            return self._move(target[0], *target[1].split("/moveTo/o/", 1))
        reads = target and not url.path.startswith("/upload/") and method in ("GET", "DELETE")
        if reads and self._precondition_failed(method, target, query):
            return
        if method == "POST" and url.path.startswith("/upload/") and "ifGenerationMatch" in query:
            name = query.get("name", [""])[0] or _upload_name(body)
            bucket = url.path.split("/b/", 1)[1].split("/", 1)[0]
            meta = self._metadata(bucket, name) if name else None
            want = query["ifGenerationMatch"][0]
            have = meta["generation"] if meta else "0"
            if str(have) != want:
                return self._json(412, {"error": {"code": 412, "message": "conditionNotMet"}})
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        status, resp_headers, data = self._call(method, self.path, body, headers)
        media = (
            method == "GET"
            and target
            and (url.path.startswith("/download/") or query.get("alt") == ["media"])
        )
        if media and status in (200, 206):
            names = {k.lower() for k, _ in resp_headers}
            meta = self._metadata(*target) if "x-goog-generation" not in names else None
            if meta:
                resp_headers.append(("x-goog-generation", str(meta["generation"])))
                resp_headers.append(("x-goog-metageneration", str(meta.get("metageneration", 1))))
        self._reply(status, resp_headers, data)

    def _precondition_failed(self, method: str, target, query) -> bool:
        conditions = {
            k: query[k][0] for k in ("ifGenerationMatch", "ifGenerationNotMatch") if k in query
        }
        if not conditions:
            return False
        meta = self._metadata(*target)
        have = str(meta["generation"]) if meta else "0"
        if "ifGenerationMatch" in conditions and have != conditions["ifGenerationMatch"]:
            if meta is None:
                self._json(404, {"error": {"code": 404, "message": "No such object"}})
            else:
                self._json(412, {"error": {"code": 412, "message": "conditionNotMet"}})
            return True
        if "ifGenerationNotMatch" in conditions and have == conditions["ifGenerationNotMatch"]:
            self._reply(304, [("x-goog-generation", have)], b"")
            return True
        return False

    def _move(self, bucket: str, source: str, dest: str) -> None:
        src, dst = (urllib.parse.quote(x, safe="") for x in (source, dest))
        status, headers, data = self._call(
            "POST", f"/storage/v1/b/{bucket}/o/{src}/copyTo/b/{bucket}/o/{dst}"
        )
        if status == 200:
            self._call("DELETE", f"/storage/v1/b/{bucket}/o/{src}")
        self._reply(status, headers, data)

    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_PATCH(self):
        self._handle("PATCH")

    def do_DELETE(self):
        self._handle("DELETE")


class _EmulatorRequest:
    """A request as the emulator's router reads it from its HTTP handler (path, headers, body)
    and answers it (status, headers, body), for a request the proxy has read already: no
    second HTTP server, connection or parse per request."""

    def __init__(self, storage, method: str, path: str, headers, body: bytes, host: str):
        self.storage, self.command, self.path = storage, method, path
        self.server = types.SimpleNamespace(server_address=("127.0.0.1", 0))
        self.headers = email.message.Message()  # what http.server gives: .get ignores case
        for key, value in headers.items():
            self.headers[key] = value
        self.headers["Host"], self.headers["Content-Length"] = host, str(len(body))
        self.rfile, self.wfile = io.BytesIO(body), io.BytesIO()
        self.status, self.reply_headers = 500, []

    def send_response(self, code: int, message: str | None = None) -> None:
        self.status = code

    def send_header(self, key: str, value: str) -> None:
        self.reply_headers.append((key, value))

    def end_headers(self) -> None:
        pass


def serve(data_dir: str, bucket: str, port: int, lifetime: float, parent_pid: int | None):
    from gcp_storage_emulator.handlers import buckets
    from gcp_storage_emulator.server import Router
    from gcp_storage_emulator.storage import Storage

    os.makedirs(data_dir, exist_ok=True)
    storage = Storage(data_dir=data_dir)
    buckets.create_bucket(bucket, storage)  # unless a restarted server finds it
    flush = _deferred_metadata_writes(storage)
    Proxy.storage, Proxy.router, Proxy.faults = storage, Router, Faults()
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", port), Proxy)
    proxy.daemon_threads = True
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # Started.stop(): flush, then exit
    print(f"READY {proxy.server_address[1]}", flush=True)
    deadline = time.time() + lifetime
    try:
        while time.time() < deadline:
            if parent_pid and not _alive(parent_pid):
                break
            flush()
            time.sleep(0.5)
    finally:
        proxy.shutdown()
        flush()


def _deferred_metadata_writes(storage) -> Callable[[], None]:
    """The emulator rewrites its metadata file (every object's JSON, in DATA_DIR/.meta) after
    each upload or delete: a cost that grows with the bucket (66 ms of CPU a write once it
    holds 3,000 objects, which a test module reaches). The writes are only marked here, and
    `flush()` (every 0.5 s from the main loop, and when the server stops) writes the file
    once, under the proxy's lock (no request is in the emulator meanwhile). Requests are
    served from memory either way; a restarted server finds the bucket as it was flushed."""
    write, dirty = storage._write_config_to_file, threading.Event()
    storage._write_config_to_file = dirty.set

    def flush() -> None:
        with Proxy.lock:
            if dirty.is_set():
                dirty.clear()
                try:
                    write()
                except Exception:  # noqa: BLE001 - reported; the next flush tries again
                    dirty.set()
                    traceback.print_exc()

    return flush


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--bucket", default="tx-jax-test")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lifetime", type=float, default=1800)
    parser.add_argument("--parent_pid", type=int, default=0)
    args = parser.parse_args()
    serve(args.data_dir, args.bucket, args.port, args.lifetime, args.parent_pid or None)


if __name__ == "__main__":
    main()
