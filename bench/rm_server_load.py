"""Load on ``textgym serve-rm``: requests/s and p50/p99 latency at batch 1, 16 and 64, local only.

Starts ``textgym serve-rm`` (the embedded RM unless ``--reward-model``) on 127.0.0.1 at a free port, or
uses ``--url``, then for each batch size sends ``--requests`` POSTs of that many episodes from
``--clients`` concurrent clients (bounded as well by ``--seconds`` per batch size). Each episode is an
eval prompt with a 24-token-ish response. Printed per batch size: requests/s, episodes/s, p50 and p99
latency of the scored requests, how many were turned away with 429 (the server's ``--max-pending``), and
episodes per model call (from the server's ``/health`` counter: how much the micro-batcher joined concurrent
requests). One warm-up request per batch size is not counted.

``--slow-connections N`` then measures the server under N connections that never finish their request
head (a slowloris): what they are answered (408 after ``--client-timeout``, 503 past ``--max-connections``)
and the latency of a normal request sent while they are open.

    python bench/rm_server_load.py                       # batch 1, 16, 64; 8 clients; 200 requests each
    python bench/rm_server_load.py --quick               # batch 1, 16; 2 clients; 8 requests each
    python bench/rm_server_load.py --batches 1 --clients 200 --requests 2000 --slow-connections 1100
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from textgym.models import EVAL_PROMPTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESPONSE = " was one of the best films I have seen this year, with a warm story and a great cast."


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server's base URL (default: start one here)")
    parser.add_argument("--reward-model", default=None, help="served by the started server (default: embedded)")
    parser.add_argument("--batches", default="1,16,64", help="episodes per request, comma-separated")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=200, help="requests per batch size (all clients)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time limit per batch size")
    parser.add_argument("--threads", type=int, default=None, help="the started server's torch threads")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 16, 2 clients, 8 requests each")
    parser.add_argument("--slow-connections", type=int, default=0, help="then hold this many connections that "
                        "never finish their request head, and time a normal request meanwhile")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.clients, args.requests, args.seconds = "1,16", 2, 8, 30.0
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``textgym serve-rm`` on a free loopback port, once ``/health`` answers (at most 120 s)."""
    port = free_port()
    cmd = [sys.executable, "-m", "textgym.cli", "serve-rm", "--port", str(port)]
    cmd += ["--reward-model", args.reward_model] if args.reward_model else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"serve-rm did not start: {proc.communicate()[1][-2000:]}")


def load(url: str, batch: int, clients: int, requests: int, seconds: float) -> dict[str, float]:
    """Send ``requests`` requests of ``batch`` episodes from ``clients`` threads; latencies and totals."""
    prompts = [p for p in EVAL_PROMPTS.read_text().splitlines() if p.strip()]
    body = {"prompts": [prompts[i % len(prompts)] for i in range(batch)], "responses": [RESPONSE] * batch}
    latencies, lock, left, rejected = [], threading.Lock(), [requests], [0]
    deadline = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < deadline:
                with lock:
                    if not left[0]:
                        return
                    left[0] -= 1
                start = time.perf_counter()
                response = http.post(f"{url}/score", json=body)
                if response.status_code == 429:  # turned away at once: the client backs off and retries
                    with lock:
                        rejected[0] += 1
                    continue
                response.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - start)

    httpx.post(f"{url}/score", json=body, timeout=120).raise_for_status()  # warm-up, not counted
    calls_before = httpx.get(f"{url}/health").json()["score_calls"]
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    calls = httpx.get(f"{url}/health").json()["score_calls"] - calls_before
    lat = np.array(latencies) * 1000
    return {"batch": batch, "requests": len(lat), "wall_s": wall, "req_per_s": len(lat) / wall,
            "episodes_per_s": len(lat) * batch / wall, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "episodes_per_call": len(lat) * batch / max(calls, 1),
            "rejected_429": rejected[0]}  # fmt: skip


def slow_connections(url: str, count: int, seconds: float = 30.0) -> dict[str, float]:
    """Hold ``count`` connections that send half a request head; time a normal request meanwhile.

    Returns the normal request's status and latency and how each slow connection was answered
    (408, 503, or "none" when the server had not answered within ``seconds``).
    """
    from textgym.rewards.server_limits import raise_open_files_limit

    raise_open_files_limit()  # this process holds the connections: a socket each
    host, port = url.removeprefix("http://").split(":")
    held = []
    for _ in range(count):
        try:
            conn = socket.create_connection((host, int(port)), timeout=5)
        except OSError:  # the kernel's backlog, or this process's own open-files limit
            break
        conn.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
        held.append(conn)
    start = time.perf_counter()
    try:
        status = httpx.post(f"{url}/score", json={"prompts": ["p"], "responses": [RESPONSE]}, timeout=60).status_code
    except httpx.HTTPError as err:
        status = type(err).__name__
    latency = time.perf_counter() - start
    answers = collections.Counter(_answer(conn, seconds) for conn in held)
    for conn in held:
        conn.close()
    return {"opened": len(held), "normal_status": status, "normal_ms": latency * 1000, **answers}


def _answer(conn: socket.socket, seconds: float) -> str:
    """The status a held connection was answered with ("none": nothing within ``seconds``)."""
    conn.settimeout(seconds)
    try:
        head = conn.recv(64)
    except OSError:
        return "none"
    return head.split()[1].decode() if head.startswith(b"HTTP/1.1") else "closed"


def main(argv=None) -> None:
    args = parse_args(argv)
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    try:
        print(f"server {url} ({httpx.get(f'{url}/health').json()['reward_model']}); {args.clients} clients, "
              f"at most {args.requests} requests or {args.seconds:.0f} s per batch size")  # fmt: skip
        print(f"{'batch':>5} {'requests':>8} {'req/s':>8} {'episodes/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'429s':>6} {'episodes/call':>13}")  # fmt: skip
        for batch in (int(b) for b in args.batches.split(",")):
            r = load(url, batch, args.clients, args.requests, args.seconds)
            print(f"{r['batch']:>5} {r['requests']:>8} {r['req_per_s']:>8.1f} {r['episodes_per_s']:>10.1f} "
                  f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['rejected_429']:>6} "
                  f"{r['episodes_per_call']:>13.1f}")  # fmt: skip
        if args.slow_connections:
            print(f"slow connections: {slow_connections(url, args.slow_connections, args.seconds)}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
