"""The server's action table: one handler per action of the protocol, no other."""

from __future__ import annotations

from hapi.server.server import HapiServer
from hapi.wire import ActionType


def test_every_action_has_one_handler_and_no_handler_lacks_an_action() -> None:
    assert set(HapiServer._ACTIONS) == set(ActionType)
    assert len(set(HapiServer._ACTIONS.values())) == len(ActionType)
