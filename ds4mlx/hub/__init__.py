"""Models by name: `ds4mlx pull`, `ds4mlx models` and `-m org/repo` on every command,
through huggingface_hub's cache (spec.py: names; download.py: the hub; resolve.py: the
commands' side)."""
