"""Where engines run: the Ray placement options of a role's engine actor, and disjoint CPU core
sets for CPU engines sharing one machine."""

from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.role_spec import RoleSpec


def cpu_core_sets(engines: int, cores: int) -> list[str]:
    """Disjoint core sets for `engines` CPU engines on one machine, keeping core 0 for the
    router and Ray when there are cores to spare."""
    if engines <= 0:
        return []
    spare = cores - 1
    if spare < engines:
        return [str(i % cores) for i in range(engines)]
    per_engine = spare // engines
    sets = []
    for i in range(engines):
        first = 1 + i * per_engine
        last = first + per_engine - 1
        sets.append(str(first) if first == last else f"{first}-{last}")
    return sets


class CoreSets:
    """Hands CPU engines their cores in turn, one set of cpu_core_sets per rank (an engine of
    tensor-parallel size N takes N, bound as vLLM's `VLLM_CPU_OMP_THREADS_BIND` reads them:
    "1|2"), starting over when all are taken. Without sets, engines bind as vLLM chooses."""

    def __init__(self, sets: list[str]) -> None:
        self._sets = itertools.cycle(sets) if sets else None

    def bound(self, config: EngineConfig) -> EngineConfig:
        """`config` (its role set) with the cores of its ranks."""
        if self._sets is None:
            return config
        cores = "|".join(next(self._sets) for _ in range(config.tensor_parallel_size))
        return config.model_copy(update={"cpu_cores": cores})


def placement_options(role: RoleSpec, gpus: float) -> dict:
    """Where Ray may place an engine actor of `role`: role resources pin the pools to the nodes a
    cluster YAML gives that role (and make the autoscaler add such nodes when none is free). An
    actor's resources are one bundle, so the `gpus` of a tensor-parallel engine are one node's."""
    options: dict = {"num_cpus": 0, "num_gpus": gpus}
    if role.ray_resource:
        options["resources"] = {role.ray_resource: 1}
    return options
