"""A job moves the process's imports out of the cyclic collector's walks, once, and what
comes after is collected as before (`hapi._gc`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    from hapi.client import TransferJob
    from hapi.errors import InvalidCut

    def job():
        try:  # fails at the freeze point, after the job started building
            TransferJob("resnet18", "d", "127.0.0.1:9", freeze="layer5", image_size=32)
        except InvalidCut:
            pass

    before = gc.get_freeze_count()
    job()
    frozen = gc.get_freeze_count()

    class Node:
        pass

    a, b = Node(), Node()
    a.peer, b.peer = b, a
    gone = weakref.ref(a)
    job()  # a second job freezes nothing more: the cycle above stays collectable
    del a, b
    gc.collect()
    print(before, frozen, gc.get_freeze_count(), gone() is None)
    """
)


def test_a_job_freezes_the_imports_once_and_later_cycles_are_collected() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, frozen, after, collected = done.stdout.split()
    assert int(before) == 0
    assert int(frozen) > 100_000  # torch's and torchvision's objects, and hapi's
    assert int(after) == int(frozen)
    assert collected == "True"
