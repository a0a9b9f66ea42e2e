"""`ds4mlx` command line: argument parsing only.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; only the chosen module is imported, so `ds4mlx eval
--self-test-extractors` never pays for loading MLX.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("ds4mlx.serve.cli", "OpenAI / Anthropic / Responses HTTP server"),
    "generate": ("ds4mlx.cli.generate", "generate text from a prompt"),
    "chat": ("ds4mlx.cli.generate", "interactive chat in the terminal"),
    "agent": ("ds4mlx.agent.cli", "local coding agent: tools, approvals, compaction, sessions"),
    "eval": ("ds4mlx.eval.cli", "ds4-eval harness: core and hard suites"),
    "bench": ("ds4mlx.bench.frontier", "frontier prefill/decode benchmark"),
    "convert": ("ds4mlx.io.convert", "convert a Hugging Face folder to a ds4-style GGUF"),
    "quantize": ("ds4mlx.io.quantize", "quantize a model's routed experts into a new GGUF"),
    "inspect": ("ds4mlx.io.inspect_model", "what a model file holds and the memory serving it needs"),
    "pull": ("ds4mlx.hub.pull_cli", "download a model from the Hugging Face hub (`ds4mlx pull` lists names)"),
    "models": ("ds4mlx.hub.models_cli", "the models downloaded here: sizes and the memory each needs"),
    "demo-model": ("ds4mlx.io.demo", "write the random-weight demo model and print its path"),
    "steer": ("ds4mlx.cli.steer", "directional steering: `steer build` computes a direction file"),
}


def _usage() -> str:
    lines = ["usage: ds4mlx COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`ds4mlx COMMAND -h` shows the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"ds4mlx: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"ds4mlx {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser) if name != "chat" else module.add_chat_arguments(parser)
    model_flags = [a for a in parser._actions if a.dest in ("model", "file")]  # noqa: SLF001 (no public API)
    takes_model = bool(model_flags)
    if takes_model:  # -m org/repo: a download is asked for first (hub/resolve.py)
        for a in model_flags:
            a.help = f"{a.help}; or a hub model: org/repo[:file] or a `ds4mlx pull` name" if a.help else a.help
        try:
            parser.add_argument("--yes", action="store_true", help="download a hub model (-m org/repo) without asking")
        except argparse.ArgumentError:
            pass  # the command's own --yes (agent: approve every tool) answers this too
    args = parser.parse_args(rest)
    args.command = name
    from ..hub.spec import HubError
    from ..io.modelfile import EXIT_CODE, ModelFileError

    try:
        if takes_model:
            from ..hub.resolve import resolve_args

            resolve_args(args)
        return int(module.run(args) or 0)
    except (ModelFileError, HubError) as e:  # one line naming the file, not a traceback
        print(f"ds4mlx {name}: error: {e}", file=sys.stderr)
        return EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
