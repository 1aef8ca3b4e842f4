"""KV-event records for tests that feed a prefix index by hand."""

from __future__ import annotations

from collections.abc import Sequence

from kvswitch.epp.kvindex import BlocksStored, StoredBlock


def stored(tokens: Sequence[int], block_size: int = 16) -> BlocksStored:
    """A BlockStored event of `tokens`' full blocks, from the first, with no parent."""
    return BlocksStored(tuple(StoredBlock.of(i, tokens[i * block_size:(i + 1) * block_size])
                              for i in range(len(tokens) // block_size)), None, block_size)
