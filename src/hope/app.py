"""The ``hope`` command: what users do with a trained model, and two set-up helpers.

    hope generate --model release --prompt "Once upon" [--max-new-tokens 64]
                  [--temperature 1.0] [--top-k 0] [--seed 0] [--state doc.safetensors]
    hope score --model release [--stream] FILE...
    hope memorize --model release --text doc.txt --save doc.safetensors
    hope doctor [--params params.yaml]
    hope params [--preset NAME [--write params.yaml]] [--params params.yaml] [--set key=value ...]

``--model`` takes a release bundle or a checkpoint directory (with ``--tokenizer``).
Expected errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from hope.errors import ConfigError, StageError


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="release bundle or checkpoint dir")
    parser.add_argument("--tokenizer", help="sentencepiece model (default: the bundle's)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hope", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a prompt, carrying the fast state")
    _model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = the whole vocabulary")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--state", help="start from a state saved by `hope memorize`")

    score = sub.add_parser("score", help="loss, perplexity and bits per byte of text files")
    _model_args(score)
    score.add_argument("files", nargs="+", type=Path)
    score.add_argument(
        "--stream", action="store_true",
        help="carry the fast state across windows (default: each window of the training "
        "context is a fresh context, as the eval stage scores)",
    )  # fmt: skip

    mem = sub.add_parser("memorize", help="write a document into the fast state and save it")
    _model_args(mem)
    mem.add_argument("--text", required=True, type=Path, help="UTF-8 text file")
    mem.add_argument("--save", required=True, type=Path, help="state file (.safetensors)")

    doctor = sub.add_parser("doctor", help="check this machine for the pipeline")
    doctor.add_argument("--params", type=Path, default=Path("params.yaml"))

    params = sub.add_parser("params", help="print the fully resolved config as YAML")
    params.add_argument("--preset", help="resolve this preset alone (not the params file)")
    params.add_argument("--params", type=Path, default=Path("params.yaml"))
    params.add_argument("--write", type=Path, metavar="PATH",
                        help="write the preset as a params file (needs --preset)")  # fmt: skip
    params.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")  # fmt: skip
    return parser


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StageError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise StageError(f"{path}: not UTF-8 text ({err.reason})") from None


def _generate(args: argparse.Namespace) -> None:
    from hope import infer

    run = infer.load(args.model, args.tokenizer, args.device)
    state = infer.load_state(run, args.state) if args.state else None
    result = infer.generate(
        run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, seed=args.seed, state=state,
    )  # fmt: skip
    print(args.prompt + result.text)


def _score(args: argparse.Namespace) -> None:
    from hope import infer

    run = infer.load(args.model, args.tokenizer, args.device)
    for path in args.files:
        result = infer.score(run, _read_text(path), stream=args.stream)
        print(json.dumps({"file": str(path), **result.as_dict()}))


def _memorize(args: argparse.Namespace) -> None:
    from hope import infer

    run = infer.load(args.model, args.tokenizer, args.device)
    state = infer.memorize_text(run, _read_text(args.text))
    infer.save_state(run, state, args.save)
    print(f"memorised {state.pos} tokens of {args.text} into {args.save}")


def _doctor(args: argparse.Namespace) -> int:
    from hope.doctor import run_doctor

    checks, code = run_doctor(args.params)
    for check in checks:
        print(check.line())
    return code


def _params(args: argparse.Namespace) -> None:
    from hope.config import load_config
    from hope.params_file import write_params

    if args.write is not None:
        if not args.preset:
            raise ConfigError("hope params --write needs --preset NAME")
        write_params(args.write, args.preset, args.overrides)
        print(f"wrote {args.write} (preset {args.preset})")
        return
    if args.preset:  # the preset alone: a params file holds another preset's values
        cfg = load_config(None, [f"preset={args.preset}", *args.overrides])
    else:
        cfg = load_config(args.params if args.params.is_file() else None, args.overrides)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            return _doctor(args)
        {"generate": _generate, "score": _score, "memorize": _memorize, "params": _params}[
            args.command
        ](args)
    except (ConfigError, StageError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
