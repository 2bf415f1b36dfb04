"""The model repository: derived models stored once, with lineage, queries and partial loads.

Tensors are stored once by content hash, so a fine-tuned model costs only what it changed;
manifests record each version's tensors, module tree and parent; a local SQLite catalog
indexes them for lineage and architecture queries and is rebuilt from the store at will.
"""

from hapi.repo.index.catalog_path import default_catalog_path
from hapi.repo.index.lineage import LineageNode
from hapi.repo.index.queries import PrefixMatch
from hapi.repo.index.version import ModelVersion, PushedVersion
from hapi.repo.ops.diff import ModelDiff
from hapi.repo.ops.fsck import FsckReport
from hapi.repo.ops.gc import GcReport
from hapi.repo.ops.heads import HeadInfo
from hapi.repo.ops.push import PushTransaction
from hapi.repo.ops.usage import RepoUsage
from hapi.repo.repo import ModelRepo
from hapi.repo.storage.manifest import TensorEntry, VersionManifest
from hapi.repo.storage.modules import ModuleEntry, describe_modules
from hapi.repo.storage.refs import parse_ref
from hapi.repo.storage.repo_config import RepoConfig
from hapi.repo.storage.tensors import tensor_hash

__all__ = [
    "FsckReport",
    "GcReport",
    "HeadInfo",
    "LineageNode",
    "ModelDiff",
    "ModelRepo",
    "ModelVersion",
    "ModuleEntry",
    "PrefixMatch",
    "PushTransaction",
    "PushedVersion",
    "RepoConfig",
    "RepoUsage",
    "TensorEntry",
    "VersionManifest",
    "default_catalog_path",
    "describe_modules",
    "parse_ref",
    "tensor_hash",
]
