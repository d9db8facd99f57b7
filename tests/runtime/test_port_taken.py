"""`serve` refuses an address another process already serves: its workers share the port with
each other (SO_REUSEPORT), never with a second gateway."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.config_files import write_config


def test_a_second_gateway_on_a_served_port_refuses_to_start(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "config", [{
        "name": "b0", "kind": "vllm", "url": "http://127.0.0.1:9", "models": ["acme/m"]}])
    with socket.socket() as running:  # a gateway's worker, as `serve` binds it
        running.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        running.bind(("127.0.0.1", 0))
        running.listen()
        port = running.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--config", str(folder), "--port",
             str(port)], capture_output=True, text=True, timeout=60,
            env={**os.environ, "GATEWAY_REDIS_URL": "redis://127.0.0.1:9/0"})
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: another process is already listening" \
        in done.stderr
    assert not (folder / ".gateway").exists()  # nothing was started
