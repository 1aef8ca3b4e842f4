"""The tokenizer archive the frontend takes from its target is read within a size limit, however
large its files inflate or claim to be."""

from __future__ import annotations

import io
import zipfile

import pytest

from kvswitch.errors import InternalError
from kvswitch.frontend import engine_client


def archive(size: int) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("tokenizer.json", b"0" * size)
        zf.writestr("config.json", b"{}")
    return out.getvalue()


def test_an_archive_within_the_limit_unpacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "MAX_TOKENIZER_ARCHIVE_BYTES", 10_000)
    directory = engine_client._unzip(archive(10_000))
    assert (directory / "tokenizer.json").stat().st_size == 10_000
    assert (directory / "config.json").read_bytes() == b"{}"


def test_a_file_inflating_past_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "MAX_TOKENIZER_ARCHIVE_BYTES", 10_000)
    data = archive(1_000_000)
    assert len(data) < 10_000  # small on the wire, a bomb once inflated
    with pytest.raises(InternalError, match="inflates past 10000 bytes"):
        engine_client._unzip(data)
