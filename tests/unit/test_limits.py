"""Memory limits read as a container sees them: `/proc/self/cgroup`, mountinfo and cgroup
files laid out in a directory the way the kernel lays them out."""

from __future__ import annotations

from pathlib import Path

from hapi.server.memory.budget import default_budget
from hapi.server.memory.limits import cgroup_limits, host_limit, memory_limits, tightest_limit

GiB, MiB = 1 << 30, 1 << 20
NO_LIMIT = 9223372036854771712  # what cgroup v1 writes for "no limit"
V1_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
V2_MOUNT = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"
MEMINFO = "MemTotal:       {total} kB\nMemFree:  1000 kB\nMemAvailable:   {available} kB\n"


def _write(root: Path, files: dict[str, str | int]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{text}\n")


def _v1_group(root: Path, path: str, limit: int, usage: int = 0, inactive: int = 0) -> None:
    directory = f"sys/fs/cgroup/memory{path}".rstrip("/")
    _write(
        root,
        {
            f"{directory}/cgroup.procs": "",
            f"{directory}/memory.limit_in_bytes": limit,
            f"{directory}/memory.usage_in_bytes": usage,
            f"{directory}/memory.stat": f"cache 0\ntotal_inactive_file {inactive}\n",
        },
    )


def _host(root: Path, total: int = 64 * GiB, available: int = 60 * GiB) -> None:
    _write(root, {"proc/meminfo": MEMINFO.format(total=total >> 10, available=available >> 10)})


def test_the_process_own_v1_group_and_its_ancestors_bind_not_the_root_nor_a_sibling(
    tmp_path: Path,
) -> None:
    _host(tmp_path)
    _write(
        tmp_path,
        {
            "proc/self/cgroup": "9:name=systemd:/\n4:memory:/pod/ctr\n3:cpuset:/\n0::/\n",
            "proc/self/mountinfo": f"{V1_MOUNT.format(root='/')}\n{V2_MOUNT}\n",
        },
    )
    _v1_group(tmp_path, "", NO_LIMIT, usage=10 * GiB)
    _v1_group(tmp_path, "/pod", 4 * GiB, usage=GiB, inactive=400 * MiB)
    _v1_group(tmp_path, "/pod/ctr", NO_LIMIT, usage=GiB)
    _v1_group(tmp_path, "/other", 100 * MiB)  # a sibling's limit is not ours

    limits = cgroup_limits(root=tmp_path)

    assert [(lim.where, lim.limit) for lim in limits] == [("/pod", 4 * GiB)]
    # The page cache the kernel drops first is not counted as in use.
    assert limits[0].used == GiB - 400 * MiB and limits[0].what == "cgroup memory.limit_in_bytes"
    tightest = tightest_limit(root=tmp_path)
    assert tightest == limits[0]
    assert default_budget(root=tmp_path) == (4 * GiB - 624 * MiB) // 2
    assert str(tightest) == (
        "half of cgroup memory.limit_in_bytes of /pod 4.0 GiB less 624.0 MiB in use"
    )


def test_the_tightest_of_a_group_and_its_ancestor_is_taken(tmp_path: Path) -> None:
    _host(tmp_path)
    _write(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory,hugetlb:/pod/ctr\n",
            "proc/self/mountinfo": V1_MOUNT.format(root="/"),
        },
    )
    _v1_group(tmp_path, "/pod", GiB, usage=900 * MiB)  # the pod is nearly full
    _v1_group(tmp_path, "/pod/ctr", 2 * GiB, usage=300 * MiB)

    limits = cgroup_limits(root=tmp_path)

    assert [lim.where for lim in limits] == ["/pod/ctr", "/pod"]
    assert tightest_limit(root=tmp_path).where == "/pod"
    assert default_budget(root=tmp_path) == 62 * MiB


def test_a_container_that_mounts_its_own_group_as_the_root_reads_the_mount_point(
    tmp_path: Path,
) -> None:
    _host(tmp_path)
    _write(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/docker/abc\n",
            "proc/self/mountinfo": V1_MOUNT.format(root="/docker/abc"),
        },
    )
    _v1_group(tmp_path, "", 586 * 10**6, usage=200 * MiB)

    (limit,) = cgroup_limits(root=tmp_path)

    assert limit.where == "/docker/abc" and limit.limit == 586 * 10**6
    assert limit.budget == (586 * 10**6 - 200 * MiB) // 2


def test_cgroup_v2_memory_max_of_the_group_and_its_ancestors(tmp_path: Path) -> None:
    _host(tmp_path)
    # A mount point with a space: mountinfo escapes it.
    mountinfo = "30 23 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    group = "sys/fs/my cgroup/user.slice"
    _write(
        tmp_path,
        {
            "proc/self/cgroup": "0::/user.slice/app.scope\n",
            "proc/self/mountinfo": mountinfo,
            "sys/fs/my cgroup/cgroup.procs": "1",  # the root group has no memory.max
            f"{group}/memory.max": 3 * GiB,
            f"{group}/memory.current": GiB,
            f"{group}/memory.stat": f"anon {GiB}\ninactive_file {100 * MiB}\n",
            f"{group}/app.scope/memory.max": "max",
            f"{group}/app.scope/memory.current": 500 * MiB,
        },
    )

    (limit,) = cgroup_limits(root=tmp_path)

    assert (limit.what, limit.where) == ("cgroup memory.max", "/user.slice")
    assert (limit.limit, limit.used) == (3 * GiB, GiB - 100 * MiB)


def test_without_mountinfo_the_usual_mount_points_are_read(tmp_path: Path) -> None:
    _host(tmp_path)
    _write(tmp_path, {"proc/self/cgroup": "4:memory:/job\n"})
    _v1_group(tmp_path, "/job", 2 * GiB)
    assert [lim.where for lim in cgroup_limits(root=tmp_path)] == ["/job"]


def test_no_cgroup_leaves_the_host_and_the_host_is_available_memory(tmp_path: Path) -> None:
    _host(tmp_path, total=16 * GiB, available=10 * GiB)
    _write(
        tmp_path,
        {"proc/self/cgroup": "4:memory:/\n", "proc/self/mountinfo": V1_MOUNT.format(root="/")},
    )
    _v1_group(tmp_path, "", NO_LIMIT, usage=6 * GiB)

    assert cgroup_limits(root=tmp_path) == []
    assert memory_limits(root=tmp_path) == [host_limit(root=tmp_path)]
    host = tightest_limit(root=tmp_path)
    assert (host.limit, host.used, host.budget) == (16 * GiB, 6 * GiB, 5 * GiB)
    assert str(host) == "half of host memory 16.0 GiB less 6.0 GiB in use"


def test_a_host_tighter_than_the_cgroup_sets_the_budget(tmp_path: Path) -> None:
    _host(tmp_path, total=8 * GiB, available=GiB)
    _write(
        tmp_path,
        {"proc/self/cgroup": "4:memory:/ctr\n", "proc/self/mountinfo": V1_MOUNT.format(root="/")},
    )
    _v1_group(tmp_path, "/ctr", 4 * GiB, usage=GiB)
    assert tightest_limit(root=tmp_path).what == "host memory"
    assert default_budget(root=tmp_path) == GiB // 2


def test_this_machines_limits_are_read() -> None:
    limits = memory_limits("cpu")
    host = limits[0]
    assert host.what == "host memory" and 0 < host.used < host.limit
    # Whatever groups this process is in, each reads as a limit with its usage.
    assert all(lim.limit > 0 and lim.where.startswith("/") for lim in limits[1:])
    assert 0 < min(lim.budget for lim in limits) <= host.room // 2
