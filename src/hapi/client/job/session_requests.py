"""`SessionRequests`: the requests a loop's sessions open with, one per cut, on one server.

A loop opens a session for each cut it uses when the first chunk at that cut is fetched
(`Sessions`), mid-fetch. The request is built here from what the job fixed when the loop
began - the model's name, the transforms, the codec - so opening one goes on down to the
server and never back up into the job; the head of a module of the user's own is exported
and uploaded here, on first use of its cut (`UploadedHeads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hapi.client.job.export import UploadedHeads
from hapi.client.planning.codec_choice import Codec
from hapi.client.servers.source import Server
from hapi.data import Transforms
from hapi.graph import RAW
from hapi.wire import OnError, SessionRequest

__all__ = ["SessionRequests"]


@dataclass(frozen=True, kw_only=True)
class SessionRequests:
    """Builds the session request at a cut (`requests(cut)`).

    Args:
        connection: the server the sessions open on (a user's head is uploaded to it).
        model: how sessions name the model: a spec's dict, a repository version pinned by
            id, or the user's module's heads, uploaded as each cut is first used.
        freeze: the last frozen cut point.
        transforms: the loop's transforms.
        image_size: the input's height and width.
        codec: the wire dtype and compression (none for RAW, which sends bytes).
        seed: the job seed (the server seeds each sample's transforms with it).
        on_error: what the server does with a bad object.
        exact: run the head per sample.
    """

    connection: Server
    model: dict[str, Any] | str | UploadedHeads
    freeze: int
    transforms: Transforms
    image_size: int
    codec: Codec
    seed: int
    on_error: OnError
    exact: bool
    head_dtype: Literal["fp32", "bf16"] = "fp32"

    def __call__(self, cut: int) -> SessionRequest:
        """The request of a session at `cut`.

        Raises:
            InvalidRequest: a user's head that cannot be exported, or is over the server's
                limit.
        """
        model = self.model
        named = model.model(cut, self.connection) if isinstance(model, UploadedHeads) else model
        dtype, compression = self.codec
        return SessionRequest(
            model=named,
            cut=cut,
            freeze=self.freeze,
            transforms=self.transforms.to_dict(),
            image_size=self.image_size,
            wire_dtype=dtype,
            seed=self.seed,
            on_error=self.on_error,
            exact=self.exact,
            compression=compression if cut != RAW else "none",
            head_dtype=self.head_dtype,
        )
