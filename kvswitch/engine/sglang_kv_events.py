"""KV events as SGLang's radix cache publishes them: pages of `page_size` tokens.

SGLang stores KV per page (`--page-size`, 1 by default) and publishes a BlockStored per page,
its `block_size` the page size. The simulator allocates blocks of `block_size` tokens, a
multiple of the page size; `split_pages` rewrites a batch's block events into page events in
place. Page `i` of a block with hash `h` and `k` pages hashes as `page_hash(h, i)` for
`i < k - 1`, and its last page keeps `h`, so a chain's parent hash (the parent block's last
page) and removals carry over without a table: removing block `h` removes its `k` pages.
A load push's announcements of queued prompts (kvswitch's extension, `kv_events`) stay whole
blocks: the EPP cuts their token ids into its own blocks, and pages of one token would multiply
the events.
"""

from __future__ import annotations

from kvswitch.engine.kv_events import to_int64
from kvswitch.protocol import common_pb2
from kvswitch.protocol.headers import QUEUED_OWNERSHIP, WITHDRAWN_OWNERSHIP

ANNOUNCEMENTS = (QUEUED_OWNERSHIP, WITHDRAWN_OWNERSHIP)


def page_hash(block_hash: int, index: int) -> int:
    """The hash of page `index` (not the last) of block `block_hash`, as int64."""
    return to_int64(hash((block_hash, index, "sglang-page")))


def check_page_size(page_size: int, block_size: int) -> None:
    if page_size < 1 or block_size % page_size:
        raise ValueError(f"--page-size {page_size} must be at least 1 and divide the KV block "
                         f"size {block_size}")


def split_pages(batch: common_pb2.KvEventBatch, page_size: int, block_size: int) -> None:
    """Rewrites `batch`'s stored and removed blocks into pages (a no-op when they are equal)."""
    pages = block_size // page_size
    if pages == 1:
        return
    for event in batch.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            if event.stored.ownership in ANNOUNCEMENTS:
                continue
            blocks = list(event.stored.blocks)
            del event.stored.blocks[:]
            for block in blocks:
                ids = block.token_ids
                for i in range(pages):
                    event.stored.blocks.add(
                        block_hash=block.block_hash if i == pages - 1
                        else page_hash(block.block_hash, i),
                        token_ids=ids[i * page_size:(i + 1) * page_size],
                        block_size=page_size)
        elif kind == "removed":
            hashes = list(event.removed.block_hashes)
            del event.removed.block_hashes[:]
            for h in hashes:
                event.removed.block_hashes.extend(page_hash(h, i) for i in range(pages - 1))
                event.removed.block_hashes.append(h)
