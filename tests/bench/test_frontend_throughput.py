"""benchmarks/frontend_throughput.py's record of the commands it measured."""

from __future__ import annotations

from tests.support.benchmarks import load_script


def test_recorded_command_keeps_no_machine_path() -> None:
    bench = load_script("frontend_throughput")
    shown = bench.shown_command([
        "/opt/venv/bin/python", "-m", "kvswitch", "frontend", "--port", "8080",
        "--tokenizer", "/tmp/tmpab12/qwen3", "--log-level", "warning"])
    assert shown == ("python -m kvswitch frontend --port 8080 --tokenizer "
                     "<the Qwen3 tokenizer directory> --log-level warning")
    assert bench.shown_command(["/opt/venv/bin/smg", "launch", "--tokenizer-path", "/x/tok"]) \
        == "smg launch --tokenizer-path <the Qwen3 tokenizer directory>"
