"""Does a ``jax.experimental.transfer`` server survive garbage on its port? (docs/server_safety.md, transfer plane)

Each trial starts a transfer server in a child process, sends it one 64-byte payload on a fresh TCP connection and
waits: the child prints "alive" after ``--alive-s`` seconds unless the payload killed it. Payloads: 64 zero bytes,
``--random`` random ones (seeded), and an HTTP request line. Run::

    python -m lab.transfer_port_garbage            # prints one line per trial and a summary
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.experimental import transfer
    s = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    print(s.address(), flush=True)
    time.sleep(float(sys.argv[1]))
    print("alive", flush=True)
""")


def trial(payload: bytes, alive_s: float) -> dict:
    """One child transfer server, one payload: its exit code (0: it lived; -6: SIGABRT) and its fatal log line."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(alive_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    host, port = p.stdout.readline().strip().rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as conn:
        conn.sendall(payload)
        time.sleep(1.0)
    try:
        rc = p.wait(timeout=alive_s + 15)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = None
    out, err = p.communicate()
    fatal = [ln for ln in err.splitlines() if ln[:1] == "F" and ".cc:" in ln][:1]
    return {"payload": payload[:16], "rc": rc, "alive": "alive" in out, "fatal": fatal[0] if fatal else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=16, help="random 64-byte payloads")
    ap.add_argument("--alive-s", type=float, default=3.0)
    args = ap.parse_args()
    import jax

    rng = random.Random(0)
    payloads = {"zeros": [b"\0" * 64], "random": [rng.randbytes(64) for _ in range(args.random)],
                "http": [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(64, b"x")]}
    print(f"jax {jax.__version__}")
    for kind, ps in payloads.items():
        results = [trial(p, args.alive_s) for p in ps]
        for r in results:
            print(f"{kind}: {r}")
        print(f"== {kind}: {sum(not r['alive'] for r in results)} of {len(results)} killed the process")


if __name__ == "__main__":
    main()
