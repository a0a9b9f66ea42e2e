"""The family registry (ds4mlx/registry.py) is complete: every family it lists has a model
module for each of its model types, a chat protocol, a GGUF scheme and a demo config, and
every stage answers from it."""

from __future__ import annotations

import pytest

from ds4mlx import gguf_families, registry
from ds4mlx.chat.protocol import families, get_protocol
from ds4mlx.demo import demo_config
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
