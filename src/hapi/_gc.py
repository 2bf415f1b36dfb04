"""The process's long-lived objects kept out of the cyclic garbage collector's walks.

Importing torch and torchvision leaves about 360,000 objects that the cyclic collector
tracks. Each full collection walks every one (0.17 s on a 2-core machine, holding the GIL:
every fetching and serving thread stops), and the interpreter's exit walks them again
(0.9 s of a 7 s training script). They live as long as the process, so once hapi's work
is about to start - imports done - they go to the permanent generation (`gc.freeze`).
Reference counting still frees them; only cycles already unreachable at that moment stay.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_long_lived"]

_frozen = False


def freeze_long_lived() -> None:
    """Move every object alive now out of the cyclic collector's walks, once a process:
    later calls leave alone what came since (a job's own objects, collected as usual)."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
