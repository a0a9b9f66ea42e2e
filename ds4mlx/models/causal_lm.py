"""What every family's `ModelArgs` and `Model` (models/<family>.py) have in common.

* `BaseModelArgs.from_dict(config)`: a family's `ModelArgs` dataclass built from a
  Hugging Face `config.json` dict, keys it does not know ignored.  A family whose hub
  config nests the text model (`text_config`) overrides `from_dict` to pick that part,
  then calls this one.
"""

from __future__ import annotations

import dataclasses


class BaseModelArgs:
    """Mixin for a family's `@dataclass class ModelArgs`."""

    @classmethod
    def from_dict(cls, config: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})
