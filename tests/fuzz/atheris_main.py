"""One fuzz target under atheris (coverage-guided, libFuzzer), in a process of its own: libFuzzer
ends the process when it stops. kvswitch's modules are imported instrumented, so coverage of
kvswitch's own code steers the mutations. Each input goes through the target's codec to its
check; an exception is a crash (libFuzzer saves the input as `crash-*`).

    python -m tests.fuzz.atheris_main TARGET [libFuzzer options and corpus dirs]
    python -m tests.fuzz.atheris_main TARGET --seeds N DIR    # N drawn inputs, encoded, into DIR
    python -m tests.fuzz.atheris_main --each RUNS DIR         # every target briefly, see below

`--each` imports once and forks a child per target (libFuzzer ends its process), each running
RUNS inputs from the kept corpus, with new inputs, artifacts and libFuzzer's log (`log`) under
DIR/<target>; it prints "<target> exit <code>" per target and exits non-zero if any failed.
tests/fuzz/test_fuzz.py runs it; benchmarks/fuzz_long.py runs the targets long.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["kvswitch"]):
    from tests.fuzz.targets import TARGETS

CORPUS = Path(__file__).parent / "corpus"


def write_seeds(name: str, count: int, directory: Path) -> None:
    """`count` inputs drawn by the target's hypothesis strategy, each in a file named by hash."""
    import warnings

    from hypothesis.errors import NonInteractiveExampleWarning

    warnings.simplefilter("ignore", NonInteractiveExampleWarning)
    target = TARGETS[name]
    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(count):
        data = target.codec.encode(target.inputs.example())
        (directory / hashlib.sha1(data).hexdigest()).write_bytes(data)


def run_each(runs: int, directory: Path) -> int:
    """Each target for `runs` inputs in a forked child; the number that failed."""
    failed = 0
    for name in TARGETS:
        work = directory / name
        work.mkdir(parents=True, exist_ok=True)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(work / "log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            # A crash propagates out and ends this child; libFuzzer's exit hook saves the input.
            fuzz(name, [f"-runs={runs}", "-timeout=20", "-rss_limit_mb=2048", "-max_len=4096",
                        f"-artifact_prefix={work}/", str(work), str(CORPUS / name)])
            os._exit(70)  # Fuzz returns only if libFuzzer could not start
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(f"{name} exit {code}", flush=True)
        failed += code != 0
    return failed


def fuzz(name: str, options: list[str]) -> None:
    target = TARGETS[name]

    def one_input(data: bytes) -> None:
        target.check(target.codec.decode(data))

    # libFuzzer runs argv[0] through the shell for -merge: make it a command that works.
    command = f"{sys.executable} -m tests.fuzz.atheris_main {name}"
    atheris.Setup([command, *options], one_input)
    atheris.Fuzz()


def main() -> None:
    if sys.argv[1] == "--each":
        sys.exit(1 if run_each(int(sys.argv[2]), Path(sys.argv[3])) else 0)
    name, options = sys.argv[1], sys.argv[2:]
    if name not in TARGETS:
        sys.exit(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    if options[:1] == ["--seeds"]:
        write_seeds(name, int(options[1]), Path(options[2]))
        return
    fuzz(name, options)


if __name__ == "__main__":
    main()
