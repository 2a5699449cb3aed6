"""The KV transfer plane: moving a request's KV blocks from a prefill to a decode worker.

Foundations: CRC32C of pool slices (`checksum`), the per-transfer state machine (`state`), wire
messages (`descriptors`, `control`, framed by `wire`), handshake authentication (`auth`), and
the receiver's admission check (`verify`). Sessions: `SendSession` (prefill side) and
`RecvSession` (decode side) run one transfer in push or pull mode over any `Transport`; the
in-process `fake` transport injects faults. DESIGN.md section 5 is the picture.
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
from pdserve.transfer.fake import FakeFabric, FakeTransport, Fault
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Inbox, Mode
from pdserve.transfer.state import TransferState, TransferStatus
from pdserve.transfer.transport import Transport
from pdserve.transfer.verify import VerifyReport, verify_transfer

__all__ = [
    "LAYOUT_PAGED_KV",
    "PROTOCOL_VERSION",
    "CompletionNotice",
    "FakeFabric",
    "FakeTransport",
    "Fault",
    "HandshakeAuth",
    "Inbox",
    "KVLayout",
    "Mode",
    "PeerId",
    "PeerRefused",
    "RecvSession",
    "SendSession",
    "TransferDescriptor",
    "TransferState",
    "TransferStatus",
    "Transport",
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
