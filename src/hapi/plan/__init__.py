"""The planner: profiles, the cost model, choosing (cut, local share), re-planning.

Pure computation: the server measures its side and the loader its chunks; this package
only turns those numbers into decisions. Names load on first use, like `hapi.data`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hapi._lazy import lazy_exports

__all__ = [
    "HYBRID_LOCAL_WINDOW",
    "CodecChoice",
    "CodecProfile",
    "Estimate",
    "FreezeChoice",
    "LinkProfile",
    "Plan",
    "PlanChange",
    "PlannerConfig",
    "ProfileKey",
    "ReadMeasurement",
    "ReplanConfig",
    "Replanner",
    "ServerProfile",
    "TrainMeasurement",
    "TrainerProfile",
    "Workload",
    "assign",
    "best_share",
    "check_trainable",
    "choose_codec",
    "choose_freeze",
    "choose_plan",
    "default_freeze",
    "estimate",
    "head_segments",
    "measure_decode",
    "measure_heads",
    "measure_server",
    "measure_step",
    "measure_tails",
    "measure_trainer",
    "memory_per_sample",
    "time_segments",
    "wire_bytes",
]

_WHERE = {
    "HYBRID_LOCAL_WINDOW": ".cost",
    "CodecChoice": ".codecs",
    "CodecProfile": ".codecs",
    "Estimate": ".cost",
    "FreezeChoice": ".defaults",
    "LinkProfile": ".profiles",
    "Plan": ".plan",
    "PlanChange": ".replan",
    "PlannerConfig": ".choose",
    "ProfileKey": ".profiles",
    "ReadMeasurement": ".chunk_measurements",
    "ReplanConfig": ".replan_config",
    "Replanner": ".replan",
    "ServerProfile": ".profiles",
    "TrainMeasurement": ".chunk_measurements",
    "TrainerProfile": ".profiles",
    "Workload": ".cost",
    "assign": ".assign",
    "best_share": ".cost",
    "check_trainable": ".defaults",
    "choose_codec": ".codecs",
    "choose_freeze": ".defaults",
    "choose_plan": ".choose",
    "default_freeze": ".defaults",
    "estimate": ".cost",
    "head_segments": ".measure",
    "measure_decode": ".measure",
    "measure_heads": ".measure",
    "measure_server": ".measure",
    "measure_step": ".measure",
    "measure_tails": ".measure",
    "measure_trainer": ".measure",
    "memory_per_sample": ".measure",
    "time_segments": ".measure",
    "wire_bytes": ".measure",
}

if TYPE_CHECKING:
    from hapi.plan.assign import assign
    from hapi.plan.choose import PlannerConfig, choose_plan
    from hapi.plan.chunk_measurements import ReadMeasurement, TrainMeasurement
    from hapi.plan.codecs import CodecChoice, CodecProfile, choose_codec
    from hapi.plan.cost import Estimate, Workload, best_share, estimate
    from hapi.plan.defaults import FreezeChoice, check_trainable, choose_freeze, default_freeze
    from hapi.plan.measure import (
        head_segments,
        measure_decode,
        measure_heads,
        measure_server,
        measure_step,
        measure_tails,
        measure_trainer,
        memory_per_sample,
        time_segments,
        wire_bytes,
    )
    from hapi.plan.plan import Plan
    from hapi.plan.profiles import LinkProfile, ProfileKey, ServerProfile, TrainerProfile
    from hapi.plan.replan import PlanChange, Replanner
    from hapi.plan.replan_config import ReplanConfig


__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE)
