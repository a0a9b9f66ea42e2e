"""The family registry (ds4mlx/registry.py) is complete: every family it lists has a model
module for each of its model types, a chat protocol, a GGUF scheme and a demo config, and
every stage answers from it."""

from __future__ import annotations

import pytest

from ds4mlx import gguf_families, registry
from ds4mlx.chat.protocol import families, get_protocol
from ds4mlx.io.demo import demo_config
from ds4mlx.models.base import family_module


@pytest.mark.parametrize("fam", registry.FAMILIES, ids=lambda f: f.key)
def test_every_stage_knows_every_family(fam):
    for mt in fam.model_types:
        mod = family_module(mt)
        assert hasattr(mod, "Model") and hasattr(mod, "ModelArgs"), mod.__name__
        assert get_protocol(mt).family == fam.key
        table = gguf_families.for_config({"model_type": mt})
        assert mt in table.model_types
    assert demo_config(fam.key)["model_type"] in fam.model_types


def test_the_stages_list_the_registry_and_reject_other_types():
    assert families() == tuple(sorted(registry.BY_KEY))
    with pytest.raises(ValueError, match="unknown model_type 'llama'"):
        family_module("llama")
    with pytest.raises(ValueError, match="no GGUF scheme for model_type 'llama'"):
        gguf_families.for_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="unknown model family 'llama'"):
        demo_config("llama")


@pytest.mark.parametrize("fam", registry.FAMILIES, ids=lambda f: f.key)
def test_optional_columns_name_real_modules(fam):
    """The MTP head, the distributed plans and the checkpoint renames of a family come from its
    registry row: the named modules expose what speculative/mtp.py and distributed/sharding.py
    call, and the rename rules compile."""
    import importlib
    import re

    from ds4mlx.distributed.sharding import FAMILY_PLANS
    from ds4mlx.speculative import mtp

    if fam.mtp_head:
        head = importlib.import_module(fam.mtp_head)
        assert all(hasattr(head, f) for f in ("make_head", "head_weights", "init_kind", "MTPHead"))
        assert fam.mtp_label and all(mtp.head_module(t) is head for t in fam.model_types)
    if fam.distributed_plan:
        plan = importlib.import_module(fam.distributed_plan)
        assert all(hasattr(plan, f) for f in ("shard_args", "shard_weights", "install"))
        assert all(FAMILY_PLANS[t] == fam.distributed_plan for t in fam.model_types)
    for pattern, _ in fam.checkpoint_renames:
        re.compile(pattern)
    for pattern, order, target, axis in fam.checkpoint_concats:
        assert {"base", "part"} <= set(re.compile(pattern).groupindex) and "{base}" in target
        assert order is None or len(order) > 1


def test_a_family_without_a_head_is_refused_by_name():
    from ds4mlx.speculative import mtp
    from ds4mlx.speculative.options import SpecUsageError

    with pytest.raises(SpecUsageError, match="no MTP head for glm5_next models yet"):
        mtp.head_module("glm5_next")
