"""`ds4mlx steer build`: a directional-steering file from two prompt files, as
antirez/ds4 dir-steering/tools/build_direction.py builds one (same options,
same `.json` + `.f32` outputs), computed in process (steering.build_direction).
"""

from __future__ import annotations

import json
import os
import sys

DEFAULT_SYSTEM = "You are a helpful assistant."  # build_direction.py --system default


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="steer_command", metavar="build", required=True)
    b = sub.add_parser("build", help="compute a direction per layer from target and contrast prompts")
    b.add_argument("-m", "--model", help="GGUF file or HF folder (default: the random-weight demo model)")
    b.add_argument("--good-file", required=True, help="target prompts, one per line (# comments)")
    b.add_argument("--bad-file", required=True, help="contrast prompts, one per line")
    b.add_argument("--out", default="direction.json", help="metadata JSON path; the .f32 is written next to it")
    b.add_argument("--system", default=DEFAULT_SYSTEM, help=f"system prompt (default {DEFAULT_SYSTEM!r})")
    b.add_argument(
        "--component",
        choices=("ffn_out", "attn_out"),
        default="ffn_out",
        help="which layer output the direction lives in (default ffn_out)",
    )
    b.add_argument("--think", action="store_true", help="capture after <think> (default: direct answers)")
    b.add_argument("--pair-normalize", action="store_true", help="average normalized per-pair differences")
    b.add_argument("--no-orthogonalize", action="store_true", help="keep the component parallel to the contrast mean")


def run(args) -> int:
    from ..chat.messages import Conversation, Message
    from ..chat.protocol import protocol_for_model
    from ..io.loader import load
    from ..runtime import steering

    try:
        good = steering.read_prompt_lines(args.good_file)
        bad = steering.read_prompt_lines(args.bad_file)
    except (OSError, steering.SteeringError) as e:
        print(f"ds4mlx steer: {e}", file=sys.stderr)
        return 2
    model, tok = load(args.model)
    proto = protocol_for_model(model)
    thinking = proto.resolve_thinking("high", None, explicit=True) if args.think else "none"

    def render(prompt: str) -> str:
        msgs = ([Message("system", args.system)] if args.system else []) + [Message("user", prompt)]
        return proto.render(Conversation(msgs, thinking=thinking))

    def progress(i: int, n: int) -> None:
        print(f"pair {i}/{n}", file=sys.stderr, flush=True)

    result = steering.build_direction(
        model,
        tok.encode,
        good,
        bad,
        render=render,
        component=args.component,
        pair_normalize=args.pair_normalize,
        orthogonalize=not args.no_orthogonalize,
        progress=progress,
    )
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    f32 = os.path.splitext(out)[0] + ".f32"
    meta = dict(
        result.meta,
        thinking=bool(args.think),
        system=args.system,
        good_file=args.good_file,
        bad_file=args.bad_file,
        model=str(getattr(model, "path", args.model)),
        pairs=result.pairs,
    )
    with open(out, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    steering.write_directions(f32, result.directions)
    print(f"wrote {out}")
    print(f"wrote {f32}")
    return 0
