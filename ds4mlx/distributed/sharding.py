"""`Sharding(plan, group)`: what the loader asks of a plan (models/base.py `from_config`).

    args    = sharding.args(full_args)        # the rank's config (remembers the whole one)
    weights = sharding.weights(weights)       # the rank's tensors, sliced before reading
    sharding.install(model)                   # collective modules swapped in, then load

Families with plans: the registry's `distributed_plan` column (a module with shard_args,
shard_weights, install).
"""

from __future__ import annotations

import importlib

from .. import registry
from .plan import Plan

# model_type -> the module of its family's plans
FAMILY_PLANS = {t: f.distributed_plan for f in registry.FAMILIES if f.distributed_plan for t in f.model_types}


class Sharding:
    def __init__(self, plan: Plan, group):
        self.plan, self.group = plan, group
        self._full = self._family = None

    def args(self, args):
        name = FAMILY_PLANS.get(args.model_type)
        if name is None:
            known = ", ".join(FAMILY_PLANS)
            raise ValueError(f"--distributed: no sharding plan for {args.model_type!r} yet (have: {known})")
        self._family = importlib.import_module(name)
        self._full = args
        self._args = self._family.shard_args(args, self.plan)
        return self._args

    def weights(self, weights: dict) -> dict:
        return self._family.shard_weights(weights, self._full, self.plan)

    def install(self, model) -> None:
        self._family.install(model, self._args, self.plan, self.group)
        model.distributed_plan = self.plan.identity  # session.model_fingerprint reads it
