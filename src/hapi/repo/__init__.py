"""The model repository: derived models stored once, with lineage, queries and partial loads.

Tensors are stored once by content hash, so a fine-tuned model costs only what it changed;
manifests record each version's tensors, module tree and parent; a local SQLite catalog
indexes them for lineage and architecture queries and is rebuilt from the store at will.
"""

from hapi.repo.catalog_path import default_catalog_path
from hapi.repo.diff import ModelDiff
from hapi.repo.fsck import FsckReport
from hapi.repo.gc import GcReport
from hapi.repo.heads import HeadInfo
from hapi.repo.lineage import LineageNode
from hapi.repo.manifest import TensorEntry, VersionManifest
from hapi.repo.modules import ModuleEntry, describe_modules
from hapi.repo.push import PushTransaction
from hapi.repo.queries import PrefixMatch
from hapi.repo.refs import parse_ref
from hapi.repo.repo import ModelRepo
from hapi.repo.repo_config import RepoConfig
from hapi.repo.tensors import tensor_hash
from hapi.repo.usage import RepoUsage
from hapi.repo.version import ModelVersion, PushedVersion

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
