"""Flags and inputs `generate`, `chat` and `serve` share: ds4's `--prefix-file`
and `--dir-steering-*` (ds4_cli.c), reading them, and the messages every chat
turn starts with."""

from __future__ import annotations

__all__ = [
    "UsageError",
    "add_prefix_argument",
    "add_steering_arguments",
    "read_text_file",
    "load_prefix",
    "install_steering",
    "conversation_head",
    "add_vision_arguments",
    "install_vision",
    "read_image_file",
    "add_chat_template_argument",
    "chat_protocol",
    "template_protocol",
]


def add_prefix_argument(p) -> None:
    """--prefix-file (generate, chat and serve)."""
    p.add_argument(
        "--prefix-file",
        metavar="FILE",
        help="conversation prefilled before the prompt: lines USER: / ASSISTANT:, alternating, "
        "starting with USER and ending with ASSISTANT",
    )


def add_steering_arguments(p) -> None:
    """ds4's directional-steering flags (generate, chat and serve)."""
    p.add_argument(
        "--dir-steering-file", metavar="FILE", help="one float32 direction per layer (`ds4mlx steer build` writes it)"
    )
    p.add_argument(
        "--dir-steering-ffn",
        type=float,
        default=None,
        metavar="F",
        help="steer the FFN outputs: y -= F*v*dot(v,y) (default 1 with a file)",
    )
    p.add_argument(
        "--dir-steering-attn", type=float, default=None, metavar="F", help="steer the attention outputs (default 0)"
    )


def add_vision_arguments(p, images: bool = True) -> None:
    """--vision (generate, chat and serve) and --image (generate, chat)."""
    p.add_argument(
        "--vision",
        metavar="DIR|demo",
        help="image input: a Qwen3-VL vision encoder (HF folder) for the model; "
        "'demo' = a tiny random encoder for the demo models",
    )
    if images:
        p.add_argument(
            "--image", action="append", default=[], metavar="FILE", help="attach a PNG/JPEG to the prompt (repeatable)"
        )


def install_vision(args, engine) -> str | None:
    """Load --vision for the engine's model and enable image jobs; a description, or None."""
    spec = getattr(args, "vision", None)
    if not spec:
        if getattr(args, "image", None):
            raise UsageError("--image needs --vision")
        return None
    from ..vision.load import VisionLoadError, load_vision

    try:
        encoder = load_vision(spec, engine.model, engine.tokenizer)
    except (VisionLoadError, OSError, ValueError) as e:
        raise UsageError(f"--vision {spec}: {e}") from None
    engine.enable_vision(encoder)
    a = encoder.tower.args
    return f"vision encoder {encoder.name}: {a.depth} blocks, hidden {a.hidden_size}, patch {a.patch_size}"


def read_image_file(path: str):
    """--image / /read FILE.png: the file as an accepted image (chat.images.ImageInput)."""
    from ..chat import images

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read image {path}: {e.strerror or e}") from None
    try:
        return images.from_bytes(data, "image/png")
    except images.ImageError as e:
        raise UsageError(f"{path}: {e.message}") from None


def add_chat_template_argument(p) -> None:
    """--chat-template (generate, chat, serve, agent and eval)."""
    from ..chat import markers as M

    p.add_argument(
        "--chat-template",
        choices=M.CHAT_TEMPLATES,
        default=M.CHAT_TEMPLATE_DS4,
        help="prompt rendering: ds4 (default, ds4's renderer) or official (DeepSeek V4 only: byte for byte "
        "what DeepSeek's encoding_dsv4.py writes; docs/chat-template.md)",
    )


def chat_protocol(args, protocol):
    """The loaded family's `protocol` rendering with --chat-template (UsageError when the
    family has no such template)."""
    return template_protocol(getattr(args, "chat_template", None), protocol)


def template_protocol(name: str | None, protocol):
    """`protocol`'s family rendering with chat template `name` (None: `protocol` itself)."""
    from ..chat.protocol import TemplateError, get_protocol

    if not name or name == protocol.chat_template:
        return protocol
    try:
        return get_protocol(protocol.family, name)
    except TemplateError as e:
        raise UsageError(f"--chat-template {name}: {e}") from None


class UsageError(Exception):
    """A bad flag or input file: printed, exit status 2."""


def read_text_file(path: str, what: str = "prompt file") -> str:
    """--prompt-file / /read: the file's text, as written (UTF-8)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None


def load_prefix(args) -> list:
    """The --prefix-file turns ([] without one)."""
    from .prefix_file import PrefixError, load

    if not getattr(args, "prefix_file", None):
        return []
    try:
        return load(args.prefix_file)
    except PrefixError as e:
        raise UsageError(str(e)) from None


def install_steering(args, model) -> str | None:
    """Apply the --dir-steering-* flags to `model`; a description, or None."""
    from ..runtime import steering

    path = getattr(args, "dir_steering_file", None)
    if not path:
        if args.dir_steering_ffn or args.dir_steering_attn:
            raise UsageError("directional steering needs --dir-steering-file")
        return None
    try:
        s = steering.load(model, path, args.dir_steering_ffn, args.dir_steering_attn)
        steering.install(model, s)
    except steering.SteeringError as e:
        raise UsageError(str(e)) from None
    return s.describe()


def conversation_head(system: str, prefix: list) -> list:
    """The messages every turn starts with: the system prompt, then the prefix turns."""
    from ..chat.messages import Message

    return ([Message("system", system)] if system else []) + list(prefix)


def sampling_params(args):
    """The sampler settings of the flags."""
    from ..runtime.sampling import SamplingParams

    temp = 1.0 if args.temp is None else args.temp
    return SamplingParams(temperature=temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed)
