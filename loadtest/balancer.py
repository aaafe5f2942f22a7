"""A real HTTP load balancer (Debian's nginx) in front of several routers: what an operator puts
before routers that serve one cluster side by side (tests/e2e/test_two_routers.py, the faults
suite's router scenario). Streams pass as they come (no buffering); a router that refuses the
connection is skipped for the next (nginx's passive health check)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from engine.environment import free_port


@contextlib.contextmanager
def balancer(upstreams: list[str], folder: Path) -> Iterator[str]:
    """nginx in front of `upstreams` (base URLs), streaming as it receives, trying the next router
    when one refuses the connection (as a load balancer's health checks would)."""
    folder = folder.resolve()  # nginx reads relative paths from its prefix
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    servers = "\n".join(f"server {u.removeprefix('http://')} max_fails=1 fail_timeout=60s;" for u in upstreams)
    (folder / "nginx.conf").write_text(f"""
daemon off; master_process off; user root; pid {folder}/nginx.pid; error_log {folder}/error.log;
events {{}}
http {{
  access_log off;
  client_body_temp_path {folder}; proxy_temp_path {folder};
  upstream routers {{ {servers} }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://routers; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout 300s; proxy_next_upstream error timeout;
    }}
  }}
}}
""")
    process = subprocess.Popen([shutil.which("nginx"), "-p", str(folder), "-c", str(folder / "nginx.conf")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                log = folder / "error.log"
                raise RuntimeError(f"nginx did not start: {log.read_text() if log.exists() else process.returncode}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)
