"""The named models `ds4mlx pull NAME` knows: ds4's `download_model.sh` targets (the same
hub repositories and files) plus the official checkpoints.  Sizes are the files' own
(GiB, as ds4 quotes them); what each needs in memory is `ds4mlx models` / `inspect`'s."""

from __future__ import annotations

from dataclasses import dataclass

DS4_REPO = "antirez/deepseek-v4-gguf"
Q1_REPO = "adis-b/ds4-64gb-gguf"
MTP_FILE = "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf"


@dataclass(frozen=True)
class Entry:
    repo: str
    files: tuple[str, ...]  # exact names in the repo; () = the whole repository
    about: str
    gib: float | None  # on disk, about (None: the hub says, at pull)
    support: bool = False  # a support file (MTP head), not a model to load on its own


CATALOGUE: dict[str, Entry] = {
    "q2-imatrix": Entry(
        DS4_REPO,
        ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf",),
        "V4 Flash, 2-bit routed experts (imatrix): 96 and 128 GB Macs",
        81,
    ),
    "q2-q4-imatrix": Entry(
        DS4_REPO,
        (
            "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-fixed.gguf",
        ),
        "V4 Flash, 2-bit routed experts, 4-bit in the last 6 layers: 128 GB Macs",
        98,
    ),
    "q4-imatrix": Entry(
        DS4_REPO,
        ("DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf",),
        "V4 Flash, 4-bit routed experts (imatrix): 256 GB machines",
        153,
    ),
    "q2": Entry(
        DS4_REPO,
        ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf",),
        "V4 Flash, 2-bit routed experts (ds4's earlier quant, no imatrix)",
        81,
    ),
    "q4": Entry(
        DS4_REPO,
        ("DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf",),
        "V4 Flash, 4-bit routed experts (ds4's earlier quant, no imatrix)",
        153,
    ),
    "q1": Entry(
        Q1_REPO,
        ("DeepSeek-V4-Flash-IQ1S-routed-experts.gguf",),
        "V4 Flash, IQ1_S routed experts (experimental 64 GB target)",
        63,
    ),
    "mtp": Entry(
        DS4_REPO,
        (MTP_FILE,),
        "V4 Flash MTP head for speculative decoding (`--mtp FILE`), with any V4 Flash GGUF",
        3.5,
        support=True,
    ),
    "pro-q2-imatrix": Entry(
        DS4_REPO,
        ("DeepSeek-V4-Pro-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-Instruct-imatrix.gguf",),
        "V4 Pro, 2-bit routed experts (imatrix): 512 GB machines",
        430,
    ),
    "pro-q4-layers00-30": Entry(
        DS4_REPO, ("DeepSeek-V4-Pro-Q4K-Layers00-30.gguf",), "V4 Pro Q4, layers 0-30 (ds4's two-machine split)", 426
    ),
    "pro-q4-layers31-output": Entry(
        DS4_REPO,
        ("DeepSeek-V4-Pro-Q4K-Layers-31-output.gguf",),
        "V4 Pro Q4, layers 31-output (ds4's two-machine split)",
        412,
    ),
    "pro-q4-split": Entry(
        DS4_REPO,
        ("DeepSeek-V4-Pro-Q4K-Layers00-30.gguf", "DeepSeek-V4-Pro-Q4K-Layers-31-output.gguf"),
        "V4 Pro Q4, both halves of ds4's two-machine split",
        838,
    ),
    "official": Entry(
        "deepseek-ai/DeepSeek-V4-Flash",
        (),
        "V4 Flash as DeepSeek released it (FP4 experts, FP8 rest; safetensors); the MTP head inside",
        144,
    ),
    "official-v4.1": Entry(
        "deepseek-ai/DeepSeek-V4.1-Flash",
        (),
        "V4.1 Flash as DeepSeek released it; its DSpark block drafter (`--mtp`) inside",
        None,
    ),
}


def describe() -> list[str]:
    """One line per name, for `ds4mlx pull` without a name."""
    width = max(map(len, CATALOGUE))
    return [
        f"  {name:<{width}}  {f'~{e.gib:g} GiB' if e.gib else 'size: hub':>12}  {e.about}"
        for name, e in CATALOGUE.items()
    ]


__all__ = ["CATALOGUE", "Entry", "DS4_REPO", "MTP_FILE", "describe"]
