"""The KV transfer plane: moving a request's KV blocks from a prefill to a decode worker.

Foundations: CRC32C of pool slices (`checksum`), the per-transfer state machine (`state`), wire
messages (`descriptors`, `control`, framed by `wire`), handshake authentication (`auth`), and
the receiver's admission check (`verify`). Sessions: `SendSession` (prefill side) and
`RecvSession` (decode side) run one transfer in push or pull mode over any `Transport`; the
in-process `fake` transport injects faults. docs/architecture.md has the picture.

Nothing is re-exported here: import from the modules. `auth`, `descriptors`, `wire` and
`control` import without torch (the router uses them); the pool-touching modules need it.
"""
