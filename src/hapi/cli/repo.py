"""`hapi repo`: the model repository from the shell, one library call per command."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

if TYPE_CHECKING:
    from hapi.repo import LineageNode, ModelRepo, ModelVersion

repo_app = typer.Typer(
    help="Models stored once by content, with lineage and architecture queries.",
    no_args_is_help=True,
)

_REPO = typer.Option(
    "./hapi-repo",
    "--repo",
    envvar="HAPI_REPO",
    help="The repository: a directory, file:///dir or s3://bucket/prefix (env HAPI_REPO).",
)
_ENDPOINT = typer.Option(None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL).")
_CATALOG = typer.Option(None, help="Catalog file (default: a cache file per repository).")

console = Console(highlight=False)


def register(app: typer.Typer) -> None:
    """Add the `repo` group to `app`."""
    app.add_typer(repo_app, name="repo")


def _open(
    uri: str, endpoint: str | None, catalog: str | None, *, create: bool = False
) -> ModelRepo:
    """Open the repository; only a writer that adds to it (`push`) may create it."""
    from hapi.cli._stores import existing_repo, store_options
    from hapi.repo import ModelRepo

    options = store_options(endpoint)
    if not create:
        existing_repo(uri, options)  # ModelRepo.open would make a mistyped directory
    return ModelRepo.open(uri, options, catalog=catalog)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _versions(rows: list[ModelVersion], title: str, extra: dict[str, str] | None = None) -> None:
    table = Table(title=title, title_justify="left")
    for column in ("ref", "id", "parent", "created", "size", "tags", "metrics"):
        table.add_column(column)
    if extra:
        table.add_column("shared layers")
    for v in rows:
        metrics = " ".join(f"{k}={val:g}" for k, val in sorted(v.metrics.items()))
        cells = [
            v.ref,
            v.short_id,
            (v.parent or "")[:12],
            v.created[:19].replace("T", " "),
            _size(v.nbytes),
            ",".join(v.tags),
            metrics,
        ]
        if extra:
            cells.append(extra.get(v.id, ""))
        table.add_row(*cells)
    console.print(table)


@repo_app.command("ls")
def ls(repo: str = _REPO, endpoint: str = _ENDPOINT, catalog: str = _CATALOG) -> None:
    """List the newest version of every model, and what the repository stores."""
    r = _open(repo, endpoint, catalog)
    _versions(r.ls(), f"models in {r.uri}")
    u = r.usage()
    console.print(
        f"{u.versions} versions, {u.blobs} tensors: {_size(u.stored_bytes)} stored for "
        f"{_size(u.logical_bytes)} of models ({u.dedup_ratio:.2f}x)"
    )


@repo_app.command()
def log(
    name: str = typer.Argument(..., help="A model name."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """List every version of NAME, newest first."""
    _versions(_open(repo, endpoint, catalog).log(name), f"versions of {name}")


@repo_app.command()
def show(
    ref: str = typer.Argument(..., help="NAME, NAME@VERSION, NAME@ID-PREFIX or an id."),
    tensors: bool = typer.Option(False, "--tensors", help="List every tensor."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Show one version: provenance, size, layers and (with --tensors) its tensors."""
    r = _open(repo, endpoint, catalog)
    version = r.resolve(ref)
    m = r.manifest(version)
    console.print(f"[bold]{version.ref}[/]  id {version.id}")
    console.print(f"parent   {m.parent or '-'}")
    console.print(f"created  {m.created}")
    console.print(f"tags     {', '.join(m.tags) or '-'}")
    console.print(f"metrics  {', '.join(f'{k}={v:g}' for k, v in m.metrics.items()) or '-'}")
    console.print(f"spec     {m.spec or '-'}")
    console.print(
        f"tensors  {len(m.tensors)} ({len(m.hashes)} distinct), {_size(m.nbytes)}; "
        f"{len(m.layers)} layers"
    )
    if tensors:
        table = Table("key", "dtype", "shape", "hash")
        for key, t in m.tensors.items():
            table.add_row(key, t.dtype, str(list(t.shape)), t.hash[:12])
        console.print(table)


@repo_app.command()
def lineage(
    ref: str = typer.Argument(None, help="Draw the tree holding this version (default: all)."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Draw who was derived from whom."""
    r = _open(repo, endpoint, catalog)
    root = Tree(f"[bold]{r.uri}[/]")
    for node in r.lineage(ref):
        _grow(root, node, ref)
    console.print(root)


def _grow(tree: Tree, node: LineageNode, mark: str | None) -> None:
    v = node.version
    metrics = " ".join(f"{k}={val:g}" for k, val in sorted(v.metrics.items()))
    label = f"{v.ref} [dim]{v.short_id} {v.created[:19].replace('T', ' ')}[/] {metrics}"
    if mark and v.ref == mark:
        label = f"[bold]{label}[/]"
    branch = tree.add(label)
    for child in node.children:
        _grow(branch, child, mark)


@repo_app.command()
def diff(
    a: str = typer.Argument(..., help="The older version."),
    b: str = typer.Argument(..., help="The newer version."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Show which tensors differ from A to B (by content hash; no tensor is read)."""
    d = _open(repo, endpoint, catalog).diff(a, b)
    console.print(
        f"{d.a.ref} -> {d.b.ref}: {len(d.changed)} changed, {len(d.added)} added, "
        f"{len(d.removed)} removed, {d.same} shared; {_size(d.changed_bytes)} new; "
        f"{d.shared_layers} leading layers with the same architecture"
    )
    for sign, keys in (("~", d.changed), ("+", d.added), ("-", d.removed)):
        for key in keys:
            console.print(f"  {sign} {key}")


@repo_app.command()
def find(
    contains: list[str] = typer.Option(
        None, "--contains", help="Module class names; several match consecutive layers."
    ),
    prefix_of: str = typer.Option(
        None,
        help="A torchvision model name or a repository ref: versions sharing its "
        "leading layers, most first.",
    ),
    min_layers: int = typer.Option(1, help="With --prefix-of: at least this many layers."),
    name: str = typer.Option(None, help="A glob on the model name."),
    tag: str = typer.Option(None, help="A tag."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Find versions by architecture, name or tag."""
    r = _open(repo, endpoint, catalog)
    target: Any = None
    shared: dict[str, str] | None = None
    if prefix_of:
        target = _model_ref(r, prefix_of)
        shared = {m.version.id: f"{m.layers}/{m.of}" for m in r.prefix_matches(target)}
    found = r.find(
        name=name, tag=tag, contains=contains or None, prefix_of=target, min_layers=min_layers
    )
    _versions(found, "found", shared)


def _model_ref(r: ModelRepo, text: str) -> Any:
    from hapi.errors import RefNotFound
    from hapi.graph import ModelSpec, known_models

    try:
        return r.resolve(text)
    except RefNotFound:
        if text in known_models():
            return ModelSpec(name=text)
        raise


@repo_app.command()
def push(
    name: str = typer.Argument(..., help="The model name to push as."),
    model: str = typer.Option(..., help="A torchvision model name (built with weights=None)."),
    seed: int = typer.Option(0, help="Seed of the random init."),
    num_classes: int = typer.Option(None, help="Replace the classifier with this many outputs."),
    parent: str = typer.Option(None, help="The version it derives from."),
    tag: list[str] = typer.Option(None, "--tag", help="Labels (repeat the option)."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Push a named model built from its spec (for demos; code pushes with ModelRepo.push)."""
    from hapi.graph import ModelSpec, build_model

    spec = ModelSpec(name=model, seed=seed, num_classes=num_classes)
    v = _open(repo, endpoint, catalog, create=True).push(
        build_model(spec), name, parent=parent, tags=tag or (), spec=spec
    )
    console.print(
        f"pushed {v.ref} ({v.short_id}): uploaded {v.uploaded_tensors} tensors, "
        f"{_size(v.uploaded_bytes)} of {_size(v.unique_bytes)} in {v.seconds:.1f}s"
    )


@repo_app.command()
def rm(
    ref: str = typer.Argument(..., help="The version to remove."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Remove one version; `hapi repo gc` then frees the tensors nothing else uses."""
    v = _open(repo, endpoint, catalog).rm(ref)
    console.print(f"removed {v.ref} ({v.short_id})")


@repo_app.command()
def gc(
    dry_run: bool = typer.Option(False, "--dry-run", help="Report, delete nothing."),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Delete tensors no version references (skipped while pushes are running)."""
    g = _open(repo, endpoint, catalog).gc(dry_run=dry_run)
    if g.skipped:
        console.print(f"gc skipped: {g.reason}; run it again later")
        return
    verb = "would remove" if dry_run else "removed"
    # Named only when found: on S3 there are never any (a killed upload leaves nothing).
    partial = f", {g.removed_partial} partial writes of killed pushes" if g.removed_partial else ""
    console.print(
        f"{verb} {g.removed_blobs} of {g.blobs} tensors ({_size(g.removed_bytes)}), "
        f"{g.removed_manifests} abandoned manifests, {g.removed_locks} stale locks{partial}; "
        f"{g.manifests} versions kept"
    )


@repo_app.command()
def reindex(repo: str = _REPO, endpoint: str = _ENDPOINT, catalog: str = _CATALOG) -> None:
    """Rebuild the catalog from the manifests in the store."""
    n = _open(repo, endpoint, catalog).reindex()
    console.print(f"indexed {n} versions")


@repo_app.command()
def fsck(
    repair: bool = typer.Option(
        False, "--repair", help="Delete corrupt tensors, so the next push of them rewrites them."
    ),
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    catalog: str = _CATALOG,
) -> None:
    """Re-hash every stored tensor; report corrupt and missing ones (exit 1 if any)."""
    report = _open(repo, endpoint, catalog).fsck(repair=repair)
    for key, problem in report.bad_manifests.items():
        console.print(f"unreadable manifest {key}: {problem}")
    for key, problem in report.corrupt.items():
        console.print(f"corrupt {key}: {problem}" + (" (deleted)" if report.repaired else ""))
    for key, needed_by in report.missing.items():
        console.print(f"missing {key}, needed by {', '.join(needed_by[:3])}")
    console.print(
        f"checked {report.checked} tensors: {len(report.corrupt)} corrupt, "
        f"{len(report.missing)} missing; {report.manifests} manifests read, "
        f"{len(report.bad_manifests)} unreadable"
    )
    if report.unreferenced:
        maybe = " (some may belong to the unreadable manifests)" if report.bad_manifests else ""
        console.print(
            f"{len(report.unreferenced)} tensors ({_size(report.unreferenced_bytes)}) belong "
            f"to no version: hapi repo gc removes them{maybe}"
        )
    if not report.ok:
        if report.bad_manifests:
            console.print(
                "restore the unreadable manifests from a copy or delete them (their versions "
                "are lost); gc refuses to run until then"
            )
        if report.corrupt or report.missing:
            hint = "push the affected models again" if report.repaired else "run with --repair"
            console.print(f"the repository needs repair: {hint}")
        raise typer.Exit(1)
