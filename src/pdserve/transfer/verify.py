"""Receiver-side admission check: is the KV now in the pool exactly what the sender sent?

Run after the bytes landed (push: the sender's completion notice arrived; pull: the reads
finished) and before `Engine.kv_ready`: never decode from unverified KV. The caller guarantees
that no writer touches the destination blocks while this reads them. A report that is not `ok`
is a failed transfer (the decode worker then recomputes the prompt itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.checksum import slices_crc32c
from pdserve.transfer.messages import CompletionNotice, TransferDescriptor


@dataclass(frozen=True)
class VerifyReport:
    """What failed. Empty fields and `ok` mean every destination slice is verified.

    - problems: message-level faults (wrong sender instance, missing or inconsistent
      checksums); when any is present the slices were not checked.
    - stale_blocks: destination blocks whose generation moved: reused since the reservation,
      their bytes belong to someone else now (not checksummed).
    - corrupt_slices: (destination block id, layer) whose CRC32C differs from the sender's.
    """

    transfer_id: int
    problems: tuple[str, ...] = ()
    stale_blocks: tuple[int, ...] = ()
    corrupt_slices: tuple[tuple[int, int], ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.problems or self.stale_blocks or self.corrupt_slices)

    @property
    def reason(self) -> str:
        """One line for logs and `TransferStatus.fail`; empty when ok."""
        parts = list(self.problems)
        if self.stale_blocks:
            parts.append(f"{len(self.stale_blocks)} destination block(s) reused "
                         f"(generation changed): {list(self.stale_blocks[:8])}")
        if self.corrupt_slices:
            parts.append(f"{len(self.corrupt_slices)} (block, layer) slice(s) fail CRC32C: "
                         f"{list(self.corrupt_slices[:8])}")
        return "; ".join(parts)


def verify_transfer(
    cache: KVCache,
    descriptor: TransferDescriptor,
    notice: CompletionNotice | None,
    generation: Callable[[int], int],
) -> VerifyReport:
    """Check generations and CRC32C of every destination (block, layer) slice of a transfer.

    `generation` is the block manager's current generation per block (`BlockManager.generation`).
    `notice` may be None when the descriptor itself carries the checksums (pull mode).
    Raises ValueError when the inputs cannot belong together (another transfer id, a pool of
    another shape or dtype, block ids outside the pool): a caller bug, not a transfer fault.
    """
    _check_same_pool(cache, descriptor)
    problems = _message_problems(descriptor, notice)
    if problems:
        return VerifyReport(descriptor.transfer_id, problems=tuple(problems))
    expected = (notice.checksums if notice and notice.checksums else descriptor.checksums)
    pairs = zip(descriptor.dst_block_ids, descriptor.dst_generations, strict=True)
    stale = [dst for dst, gen in pairs if generation(dst) != gen]
    corrupt = _corrupt_slices(cache, descriptor, expected, set(stale))
    return VerifyReport(descriptor.transfer_id, (), tuple(stale), tuple(corrupt))


def _check_same_pool(cache: KVCache, d: TransferDescriptor) -> None:
    layout = d.layout
    dtype = str(cache.data.dtype).removeprefix("torch.")
    want_shape = (layout.num_layers, *layout.slice_shape)
    if tuple(cache.data.shape[1:]) != want_shape or dtype != layout.dtype:
        raise ValueError(
            f"transfer {d.transfer_id:016x} describes a pool [blocks, {want_shape}] of "
            f"{layout.dtype}, this pool is {list(cache.data.shape)} of {dtype}; the handshake "
            "should have refused this peer (KVLayout.check_compatible)"
        )
    if max(d.dst_block_ids) >= cache.num_blocks:
        raise ValueError(f"transfer {d.transfer_id:016x} names destination block "
                         f"{max(d.dst_block_ids)}, the pool has {cache.num_blocks} blocks")


def _message_problems(d: TransferDescriptor, notice: CompletionNotice | None) -> list[str]:
    if notice is None:
        return [] if d.checksums else ["no checksums to verify against (no notice, none in "
                                       "the descriptor)"]
    if notice.transfer_id != d.transfer_id:
        raise ValueError(f"notice for transfer {notice.transfer_id:016x} paired with "
                         f"descriptor of transfer {d.transfer_id:016x}")
    problems = []
    if notice.sender != d.sender:
        problems.append(f"notice from {notice.sender}, the transfer was set up with "
                        f"{d.sender} (restarted or foreign peer)")
    if not notice.checksums and not d.checksums:
        problems.append("no checksums to verify against (neither notice nor descriptor)")
    elif notice.checksums and len(notice.checksums) != d.num_slices:
        problems.append(f"notice carries {len(notice.checksums)} checksums for "
                        f"{d.num_slices} (block, layer) slices")
    elif notice.checksums and d.checksums and notice.checksums != d.checksums:
        problems.append("the sender's notice and descriptor disagree on checksums")
    return problems


def _corrupt_slices(
    cache: KVCache, d: TransferDescriptor, expected: tuple[int, ...], skip: set[int]
) -> list[tuple[int, int]]:
    """(dst block, layer) whose bytes in the pool do not match `expected`, skipping `skip`."""
    per_block = len(d.layers)
    live = [(i, dst) for i, dst in enumerate(d.dst_block_ids) if dst not in skip]
    got = slices_crc32c(cache.data, [dst for _, dst in live], d.layers)
    corrupt = []
    for k, (i, dst) in enumerate(live):
        for j, layer in enumerate(d.layers):
            if got[k * per_block + j] != expected[i * per_block + j]:
                corrupt.append((dst, layer))
    return corrupt
