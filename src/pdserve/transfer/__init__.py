"""The KV transfer plane: moving a request's KV blocks from a prefill to a decode worker.

    peer          PeerId: one process lifetime of a worker
    layout        KVLayout: the shape of a KV pool
    messages      every message between the two sessions of a transfer, and their decoder
    wire          the messages' framing and strict validation
    checksum      CRC32C of pool slices
    verify        the receiver's admission check
    state         the per-transfer state machine
    auth          handshake authentication (HMAC envelopes)
    permits       which peer may move which local blocks, per transfer
    transport     the `Transport` interface every transport implements
    sessions      the inbox, the peer link, the lease, and what both sessions share
    sender        SendSession: the prefill side of one transfer
    receiver      RecvSession: the decode side of one transfer
    fake          the in-process transport with injected faults
    tcp/          the TCP transport (TcpTransport, TcpOptions)
    nixl/         the NIXL transport (NixlTransport, NixlOptions; needs nixl_cu12)

docs/architecture.md has the picture. Nothing is re-exported here: import from the modules.
`peer`, `layout`, `messages`, `wire` and `auth` import without torch (the router uses them);
the pool-touching modules need it.
"""
