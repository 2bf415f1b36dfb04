"""The names of the Flight actions a hapi server answers, and what each takes and returns."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ActionType"]


class ActionType(StrEnum):
    """A Flight action's `type`. Both sides use these; no other code spells the names."""

    OPEN_SESSION = "open_session"
    CLOSE_SESSION = "close_session"
    MANIFEST = "manifest"
    STATS = "stats"
    PROFILE = "profile"
    HAS_HEAD = "has_head"
    KEEPALIVE = "keepalive"
    LOCATE = "locate"

    @property
    def description(self) -> str:
        """What the action takes and returns, for `list_actions`."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    ActionType.OPEN_SESSION: "Open a session (SessionRequest), load its head; returns SessionInfo.",
    ActionType.CLOSE_SESSION: "Close a session (CloseSessionRequest); returns its SessionStats.",
    ActionType.MANIFEST: "List a dataset under a prefix (ManifestRequest): keys, labels, classes.",
    ActionType.STATS: "The server's settings and per-session counters; returns ServerStats.",
    ActionType.PROFILE: "Measure a session's per-cut costs on some of its objects "
    "(ProfileRequest); returns ProfileReply.",
    ActionType.HAS_HEAD: "Whether an uploaded head is here (HasHeadRequest); returns HasHeadReply. "
    "Heads are uploaded with do_put to the descriptor path ['hapi-head', <digest>].",
    ActionType.KEEPALIVE: "Renew an open session's lease (KeepaliveRequest) so it is not closed "
    "as abandoned; returns {}, or SessionNotFound when the server does not hold it.",
    ActionType.LOCATE: "Which bytes of some objects lie on the server's own storage node "
    "(LocateRequest); returns LocateReply. Only a server started with --beside answers.",
}
