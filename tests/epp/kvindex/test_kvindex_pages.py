"""PageRegrouper: SGLang's radix-cache pages of any size become the index's blocks, exactly."""

from __future__ import annotations

import pytest

from kvswitch.epp.kvindex import BlocksRemoved, BlocksStored, CacheCleared, KvBlockIndex
from kvswitch.epp.kvindex.pages import PageRegrouper
from kvswitch.protocol.packed import pack_token_ids

B = 16
PROMPT = list(range(1000, 1064))  # 4 blocks of 16


def pages(tokens: list[int], size: int, first: int = 0, parent: int | None = None,
          base: int = 10_000) -> BlocksStored:
    """One stored chain of `size`-token pages, page hashes base + page number."""
    chunks = [tokens[i:i + size] for i in range(0, len(tokens) - len(tokens) % size, size)]
    blocks = tuple((base + first + i, pack_token_ids(c)) for i, c in enumerate(chunks))
    return BlocksStored(blocks, parent, size)


def indexed(events: list[object], page_size: int) -> tuple[KvBlockIndex, PageRegrouper]:
    index, regrouper = KvBlockIndex(B), PageRegrouper(B)
    index.add_endpoint("e")
    index.apply("e", regrouper.regroup(events))  # type: ignore[arg-type]
    return index, regrouper


def match(index: KvBlockIndex, tokens: list[int]) -> int:
    return index.match(index.block_hashes(tokens)).get("e", 0)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 32, 64])
def test_any_page_size_indexes_the_full_blocks(page_size: int) -> None:
    index, _ = indexed([pages(PROMPT, page_size)], page_size)
    assert match(index, PROMPT) == 4
    assert match(index, PROMPT[:40]) == 2  # only whole blocks of the query count
    assert match(index, [1, *PROMPT[1:]]) == 0


def test_pages_across_events_and_a_branch_in_mid_block() -> None:
    # Pages of 4 arrive in two events; the second chain continues from page 10_005.
    first = pages(PROMPT[:24], 4)
    rest = pages(PROMPT[24:], 4, first=6, parent=10_005)
    # Another request shares 20 tokens (5 pages: one block and 4 tokens) then diverges.
    other = [*PROMPT[:20], *range(5000, 5012)]
    branch = pages(other[20:], 4, parent=10_004, base=20_000)
    index, _ = indexed([first, rest, branch], 4)
    assert match(index, PROMPT) == 4
    assert match(index, other) == 2  # its second block completes inside the branch


def test_unknown_parent_is_dropped_and_removal_follows_pages() -> None:
    index, regrouper = indexed([pages(PROMPT, 4)], 4)
    assert regrouper.regroup([pages(PROMPT[:8], 4, parent=99)]) == []
    # Evicting the last page (which completed block 3) removes that block only.
    index.apply("e", regrouper.regroup([BlocksRemoved((10_015,))]))
    assert match(index, PROMPT) == 3
    index.apply("e", regrouper.regroup([BlocksRemoved((10_014, 10_013, 10_012, 10_011))]))
    assert match(index, PROMPT) == 2
    index.apply("e", regrouper.regroup([CacheCleared()]))
    assert match(index, PROMPT) == 0 and len(regrouper) == 0


def test_block_sized_pages_pass_through_untouched() -> None:
    event = pages(PROMPT, B)
    regrouper = PageRegrouper(B)
    assert regrouper.regroup([event]) == [event] and len(regrouper) == 0


def test_pages_not_holding_their_stated_size_are_dropped() -> None:
    event = pages(PROMPT, 4)
    short = BlocksStored(((1, pack_token_ids([1, 2, 3])),) * 5, None, 4)  # 15 ids, not 20
    regrouper = PageRegrouper(B)
    assert regrouper.regroup([short]) == [] and len(regrouper) == 0
    assert len(regrouper.regroup([event])[0].blocks) == 4  # type: ignore[union-attr]


def test_a_chain_continues_from_a_page_in_the_middle_of_an_earlier_chain() -> None:
    # 64 ids as pages of 8; another chain branches after the 3rd page (24 ids: a block and 8).
    index, regrouper = indexed([pages(PROMPT, 8)], 8)
    other = [*PROMPT[:24], *range(7000, 7040)]
    index.apply("e", regrouper.regroup([pages(other[24:], 8, parent=10_002, base=30_000)]))
    assert match(index, other) == 4 and match(index, PROMPT) == 4
    # Removing the branch's last page takes its last block only.
    index.apply("e", regrouper.regroup([BlocksRemoved((30_004,))]))
    assert match(index, other) == 3 and match(index, PROMPT) == 4
