"""The KV transfer plane: moving a request's KV blocks from a prefill to a decode worker.

Foundations (no transport here): CRC32C of pool slices (`checksum`), the per-transfer state
machine (`state`), wire messages (`descriptors`), handshake authentication (`auth`), and the
receiver's admission check (`verify`). DESIGN.md section 5 is the picture.
"""

from pdserve.transfer.auth import HandshakeAuth, PeerRefused, open_envelope, sign
from pdserve.transfer.checksum import crc32c, slice_crc32c, slices_crc32c
from pdserve.transfer.descriptors import (
    LAYOUT_PAGED_KV,
    PROTOCOL_VERSION,
    CompletionNotice,
    KVLayout,
    PeerId,
    TransferDescriptor,
    decode_message,
    process_instance_id,
)
from pdserve.transfer.state import TransferState, TransferStatus
from pdserve.transfer.verify import VerifyReport, verify_transfer

__all__ = [
    "LAYOUT_PAGED_KV",
    "PROTOCOL_VERSION",
    "CompletionNotice",
    "HandshakeAuth",
    "KVLayout",
    "PeerId",
    "PeerRefused",
    "TransferDescriptor",
    "TransferState",
    "TransferStatus",
    "VerifyReport",
    "crc32c",
    "decode_message",
    "open_envelope",
    "process_instance_id",
    "sign",
    "slice_crc32c",
    "slices_crc32c",
    "verify_transfer",
]
