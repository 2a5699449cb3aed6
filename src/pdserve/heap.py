"""The garbage collector in a server process.

Start-up (torch, transformers, the model, the tokenizer) leaves a heap of objects that live
until exit, and every full collection walks all of them with the GIL held: 170 ms in a worker
(its engine thread stalled: a decode step's worth, ten times over) and 186 ms in the router
(every stream's relay stalled), once every ~20 s at 64 streams (gc.callbacks, 2 cores).
`freeze_startup_heap` moves them out of the collector's sight once start-up is done (what
`gc.freeze` is for), so later collections walk only what serving made.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left as garbage, then freeze the rest (called once, when ready)."""
    gc.collect()
    gc.freeze()
