"""`colembed serve` under a slow-client attack, on loopback only: /healthz latency and ordinary
clients' success while `--slow` sockets send half a request head and stop.

    python -m benchmarks.serve_slow_clients                  # 1,100 sockets, 2 x 60 s
    python -m benchmarks.serve_slow_clients --seconds 20     # a quick look (not committed)

Setup: the tiny random-weight model (exported once into $COLEMBED_BENCH_DIR) and an index of a few
rendered pages; the server is `python -m colembed.cli serve` as users run it (its own process,
the store in its child process, the shipped connection settings: serve/connections.py).

Two phases of `--seconds` each, the same probes in both:
- a /healthz prober: one GET every `--interval` seconds, each on a new connection (as a
  monitoring check connects), latency and status recorded;
- `--clients` ordinary clients, each a loop of POST /v1/search (k=3) on a new connection;
- phase "attack" adds one attacker thread holding `--slow` sockets, each sending
  `GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n` and nothing more; a socket the server closes is opened
  again at once, so the attacker keeps the count up for the whole phase.
Reported per phase: /healthz p50/p99/max and status counts, search successes / attempts and
p50/p99, attacker sockets open at the end and how many the server closed. Bounded: `--slow` <=
5,000 and `--seconds` <= 600, loopback only.

Writes benchmarks/results/serve/serve-slow-clients.{md,json} (a run of fewer than 60 s per phase:
serve-slow-clients-quick.*).
"""

from __future__ import annotations

import argparse
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.shared.common import (
    BENCH_WORKDIR,
    load_average,
    machine_info,
    markdown_table,
    results_markdown,
    tiny_folder,
    write_results,
)
from benchmarks.shared.served import free_port, start_server

HERE = Path(__file__).resolve().parent

HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"  # a head that never ends


def build_index(db: Path, model: Path, docs: Path) -> None:
    from PIL import Image, ImageDraw

    docs.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        image = Image.new("RGB", (448, 448), "white")
        ImageDraw.Draw(image).text(
            (20, 20 + 30 * i), f"report page {i}: revenue by region", fill="black"
        )
        image.save(docs / f"page{i}.png")
    if not db.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "colembed.cli",
                "index",
                str(docs),
                "--db",
                str(db),
                "--model",
                str(model),
                "--quiet",
            ],
            check=True,
        )


class Attacker(threading.Thread):
    """Holds `count` half-sent heads, opening a new one for each the server closes."""

    def __init__(self, port: int, count: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.count, self.stop = port, count, stop
        self.closed_by_server = 0
        self.open_at_end = 0
        self.connect_failures = 0

    def _open(self, selector) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            s.sendall(HEAD)
            s.setblocking(False)
            selector.register(s, selectors.EVENT_READ)
        except OSError:
            self.connect_failures += 1

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        for _ in range(self.count):
            self._open(selector)
        while not self.stop.is_set():
            for key, _ in selector.select(timeout=0.2):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(s)
                    s.close()
                    self.closed_by_server += 1
                    if not self.stop.is_set():
                        self._open(selector)
        self.open_at_end = len(selector.get_map())
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()


def phase(url: str, port: int, seconds: float, clients: int, interval: float, slow: int) -> dict:
    import httpx

    stop = threading.Event()
    healthz: list[tuple[float, int]] = []
    searches: list[tuple[float, int]] = []

    def probe() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                status = httpx.get(url + "/healthz", timeout=30).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            healthz.append((time.perf_counter() - start, status))
            time.sleep(interval)

    def client() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                status = httpx.post(
                    url + "/v1/search", json={"query": "revenue by region", "k": 3}, timeout=30
                ).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            searches.append((time.perf_counter() - start, status))

    attacker = Attacker(port, slow, stop) if slow else None
    if attacker:
        attacker.start()
        time.sleep(2)  # the sockets are open before the probes start
    threads = [threading.Thread(target=probe)] + [
        threading.Thread(target=client) for _ in range(clients)
    ]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    if attacker:
        attacker.join(60)

    def summary(samples):
        ok = [t for t, s in samples if s == 200]
        counts: dict[str, int] = {}
        for _, s in samples:
            counts[str(s)] = counts.get(str(s), 0) + 1
        ms = lambda p: round(float(np.percentile(ok, p)) * 1000, 1) if ok else None  # noqa: E731
        return {
            "requests": len(samples),
            "ok": len(ok),
            "statuses": counts,
            "p50_ms": ms(50),
            "p99_ms": ms(99),
            "max_ms": round(max(ok) * 1000, 1) if ok else None,
        }

    return {
        "seconds": seconds,
        "slow_sockets": slow,
        "healthz": summary(healthz),
        "search": summary(searches),
        "attacker": None
        if not attacker
        else {
            "open_at_end": attacker.open_at_end,
            "closed_by_server": attacker.closed_by_server,
            "connect_failures": attacker.connect_failures,
        },
    }


def report(results: dict, info: dict) -> str:
    rows = []
    for name, r in results["phases"].items():
        h, s, a = r["healthz"], r["search"], r["attacker"]
        rows.append(
            [
                name,
                r["slow_sockets"],
                f"{h['ok']}/{h['requests']}",
                h["p50_ms"],
                h["p99_ms"],
                h["max_ms"],
                f"{s['ok']}/{s['requests']}",
                s["p50_ms"],
                s["p99_ms"],
                "-" if a is None else a["open_at_end"],
                "-" if a is None else a["closed_by_server"],
            ]
        )
    body = [
        f"{results['seconds']:.0f} s per phase, {results['clients']} search clients, /healthz "
        f"every {results['interval']} s; every request on a new loopback connection. The tiny "
        "random-weight model (a search is ~ms): what is measured is the server's connection "
        "handling, not the model. Load average at the end: "
        f"{', '.join(f'{x:.2f}' for x in results['load_at_end'] or [])} (a shared 2-core machine: "
        "compare the phases with each other, not with another run).",
        "",
        *markdown_table(
            [
                "phase",
                "slow sockets",
                "healthz 200",
                "healthz p50 ms",
                "healthz p99 ms",
                "healthz max ms",
                "search 200",
                "search p50 ms",
                "search p99 ms",
                "attacker open at end",
                "closed by server",
            ],
            rows,
        ),
        "",
        "Statuses other than 200 (per phase): "
        + "; ".join(
            f"{name}: healthz {r['healthz']['statuses']}, search {r['search']['statuses']}"
            for name, r in results["phases"].items()
        ),
        "",
        "The server closes a half-sent head after its deadline (10 s) and, past its "
        "connection bound, the sockets that have waited longest for a head "
        "(colembed/serve/connections.py); the attacker opens a new socket for each one closed.",
    ]
    return results_markdown("`colembed serve` under a slow-client attack (loopback)", info, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=1100)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--workdir", type=Path, default=BENCH_WORKDIR)
    args = parser.parse_args()
    if not (0 < args.slow <= 5000 and 0 < args.seconds <= 600):
        raise SystemExit("--slow must be 1..5000 and --seconds 1..600 (bounded on purpose)")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.slow + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    info = machine_info()
    work = args.workdir / "serve-slow-clients"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_folder(args.workdir / "serve")
    db = work / "index"
    build_index(db, model, work / "docs")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(db, model, port, work / "server.log", ("--quiet",))
    try:
        results = {
            "seconds": args.seconds,
            "clients": args.clients,
            "interval": args.interval,
            "phases": {},
        }
        for name, slow in (("baseline", 0), ("attack", args.slow)):
            print(f"{name} ...", file=sys.stderr)
            results["phases"][name] = phase(
                url, port, args.seconds, args.clients, args.interval, slow
            )
        results["load_at_end"] = load_average()
    finally:
        proc.terminate()
        proc.wait(60)
    stem = (
        HERE
        / "results"
        / "serve"
        / ("serve-slow-clients" if args.seconds >= 60 else "serve-slow-clients-quick")
    )
    text = report(results, info)
    write_results(stem, text, info, results)
    print(text)


if __name__ == "__main__":
    main()
