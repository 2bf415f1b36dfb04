"""`hapi serve --beside auto`: the volume server a `weed` command line runs."""

from __future__ import annotations

import pytest

from hapi.data.store.seaweed import volume_url

WEED = "/opt/bin/weed"


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        ([WEED, "volume", "-port=8081", "-ip=10.0.0.5"], "http://127.0.0.1:8081"),
        ([WEED, "-logtostderr", "volume", "-ip.bind=10.0.0.5", "-port", "9000"],
         "http://10.0.0.5:9000"),
        ([WEED, "volume", "-dir=/data"], "http://127.0.0.1:8080"),
        ([WEED, "-config_dir", "/etc/weed", "server", "-volume.port=8085", "-port=9333"],
         "http://127.0.0.1:8085"),
        ([WEED, "mini", "--volume.port=8086", "-ip.bind=0.0.0.0"], "http://127.0.0.1:8086"),
        (["weed", "server", "-dir=/d"], "http://127.0.0.1:8080"),
    ],
)  # fmt: skip
def test_a_volume_servers_url_comes_from_its_flags(argv: list[str], url: str) -> None:
    assert volume_url(argv) == url


@pytest.mark.parametrize(
    "argv",
    [
        [WEED, "master", "-port=9333"],
        [WEED, "filer", "-port=8888"],
        [WEED, "-logtostderr", "shell", "-master=127.0.0.1:9333"],
        ["/usr/bin/python3", "-m", "weed", "volume"],
        [],
    ],
)
def test_other_processes_run_no_volume_server(argv: list[str]) -> None:
    assert volume_url(argv) is None
