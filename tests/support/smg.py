"""The real SMG (`smg` from PyPI) in tests: where its binary is, and when it serves a model."""

from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path


def smg_binary() -> str | None:
    """The `smg` installed beside this Python, else on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


def served_models(port: int) -> list[str]:
    """The model ids SMG on `port` lists ([] while it is not up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as answer:
            return [m["id"] for m in json.loads(answer.read())["data"]]
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return []


def answers(port: int) -> bool:
    """Whether SMG on `port` completes a one-token request: it lists a worker's model before
    its tokenizer is registered, and answers "Tokenizer not yet registered" meanwhile."""
    models = served_models(port)
    if not models:
        return False
    body = json.dumps({"model": models[0], "prompt": "ready", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False
