"""The `qwen38` command: run, chat, serve, info, add, models, fetch-demo, make-tiny."""

from __future__ import annotations

import argparse
import sys
import threading
import warnings
from pathlib import Path

from .errors import Qwen38Error
from .interrupts import first_sigint_cancels


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most tokens to generate (default: the model's, cut to its window); 0 reads the "
        "prompt into the prefix store and generates nothing (a later call reuses it)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument(
        "--think",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="enable or disable the model's thinking (Qwen templates)",
    )
    p.add_argument("--dtype", default=None, help="compute dtype: float32, bfloat16, float16")
    _add_engine_flags(p)
    p.add_argument("--stats", action="store_true", help="print usage and speed to stderr")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """KV store and draft options (run, chat and serve)."""
    _add_kv_flags(p)
    p.add_argument(
        "--draft",
        choices=["auto", "mtp", "ngram", "off"],
        default=None,
        help="speculative decoding drafts (same tokens, fewer forwards): auto = the MTP head "
        "when the model has one; ngram = copy from earlier text (rewrites, quoting)",
    )
    p.add_argument("--draft-tokens", type=int, default=None, help="draft tokens per round (k)")


def _add_kv_flags(p: argparse.ArgumentParser) -> None:
    """KV store options (run, chat, serve, and info's memory plan)."""
    p.add_argument("--kv-paged", choices=["on", "off", "auto"], default=None)
    p.add_argument("--kv-topk", type=int, default=None, help="sparse decode token budget")
    p.add_argument("--kv-page-tokens", type=int, default=None)
    p.add_argument("--kv-sinks", type=int, default=None)
    p.add_argument("--kv-recent", type=int, default=None)
    p.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=None,
        help="KV tokens kept in RAM per attention layer; older pages spill to disk",
    )
    p.add_argument("--kv-spill-dir", default=None, help="directory for the KV spill files")


def _kv_options(args: argparse.Namespace) -> dict:
    """The KV options given on the command line."""
    from .kv import KV_OPTION_KEYS

    # each has its --kv-... flag
    return {k: getattr(args, k) for k in sorted(KV_OPTION_KEYS) if getattr(args, k) is not None}


def _engine_options(args: argparse.Namespace) -> dict:
    """The KV and draft options given on the command line."""
    opts = _kv_options(args)
    for name in ("draft", "draft_tokens"):
        if getattr(args, name, None) is not None:
            opts[name] = getattr(args, name)
    return opts


def _options(args: argparse.Namespace) -> dict:
    opts = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
    )
    opts.update(_engine_options(args))
    if args.think is not None:
        opts["enable_thinking"] = args.think
    return opts


def _stream_turn(session, messages: list[dict], args: argparse.Namespace) -> tuple[str, bool]:
    """Stream one assistant turn to stdout (reasoning to stderr, dimmed); return the answer
    and whether Ctrl-C ended it early."""
    from .prefix_store import StateFileWarning

    with (
        first_sigint_cancels(threading.Event()) as cancel,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always", StateFileWarning)
        events = session.generate(messages, cancel=cancel, **_options(args))
        answer = _print_events(session, events, args)
    # state-file problems (corrupt file, full disk): one line each, after the answer
    for message in dict.fromkeys(str(w.message) for w in caught):
        sys.stderr.write(f"qwen38: {message}\n")
    if cancel.is_set():
        sys.stderr.write("qwen38: interrupted\n")
    return answer, cancel.is_set()


def _print_events(session, events, args: argparse.Namespace) -> str:
    answer = []
    for event in events:
        if event.type == "text":
            answer.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif event.type == "reasoning":
            sys.stderr.write(f"\x1b[2m{event.text}\x1b[0m" if sys.stderr.isatty() else event.text)
            sys.stderr.flush()
        elif event.type == "tool_call":
            call = event.tool_call
            sys.stdout.write(f"\n[tool call] {call.name}({call.arguments})\n")
        elif event.type == "done" and args.stats:
            s = session.last_stats
            sys.stderr.write(
                f"\n[{event.finish_reason}] prompt {s.prompt_tokens} (cached {s.cached_tokens}), "
                f"generated {s.generated_tokens}; prefill {s.prefill_tokens_per_second:.1f} tok/s, "
                f"decode {s.decode_tokens_per_second:.1f} tok/s\n"
            )
            if s.draft:
                sys.stderr.write(
                    f"draft {s.draft}: accepted {s.accepted}/{s.drafted} "
                    f"({s.acceptance_rate:.0%}), {s.tokens_per_forward:.2f} tokens per forward\n"
                )
    sys.stdout.write("\n")
    return "".join(answer)


def _messages(system: str | None, prompt: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": prompt}]


def cmd_run(args: argparse.Namespace) -> int:
    import qwen38_backend

    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    model = qwen38_backend.load(args.model, dtype=args.dtype)
    _, interrupted = _stream_turn(model.session(), _messages(args.system, prompt), args)
    return 130 if interrupted else 0


# what ends `qwen38 chat` (llm chat's words, and the slash forms other chat tools use)
QUIT_WORDS = ("exit", "quit", "/exit", "/quit", "/bye")


def cmd_chat(args: argparse.Namespace) -> int:
    import qwen38_backend

    model = qwen38_backend.load(args.model, dtype=args.dtype)
    session = model.session()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with", args.model, "(Ctrl-D or 'exit' to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if line.strip().lower() in QUIT_WORDS:
            return 0
        if not line.strip():  # nothing typed: ask again rather than send an empty turn
            continue
        messages.append({"role": "user", "content": line})
        answer, _ = _stream_turn(session, messages, args)  # Ctrl-C ends the turn, not the chat
        messages.append({"role": "assistant", "content": answer})


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import serve

    return serve(
        args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        sessions=args.sessions,
        max_queue=args.max_queue,
        quiet=args.quiet,
        defaults=_engine_options(args),
    )


def cmd_info(args: argparse.Namespace) -> int:
    from .info import describe

    kv = _kv_options(args)
    if kv and args.context is None:
        from .errors import InvalidOptionError

        raise InvalidOptionError("--kv-* options shape the memory plan: give --context N too")
    print(describe(args.model, context=args.context, ranks=args.ranks, **kv))
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    from .errors import InvalidOptionError

    if (args.path is None) == (args.url is None):
        raise InvalidOptionError("give a PATH to weights or --url of a server (one of them)")
    if args.url is not None:
        from .loading.registry import add_served

        name, url, model = add_served(args.url, args.name, args.model, args.default)
        print(f"added {name} -> {model} served at {url}")
    else:
        from .loading.registry import add_weights

        name, target, weights = add_weights(args.path, args.name, make_default=args.default)
        arch = weights.config.get("model_type", "?")
        print(f"added {name} -> {target} ({arch}, {weights.format})")
    if args.default:
        print(f"{name} is now the default model (`qwen38`, `llm -m qwen38`)")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .loading.registry import Registry

    reg = Registry()
    entries = reg.list()
    default = reg.default
    print("qwen38-demo  (embedded demo model: SmolLM2-135M-Instruct, fetched on first use)")
    for name, entry in entries.items():
        if name == "qwen38-demo":
            continue
        mark = "  (default)" if name == default else ""
        where = entry.get("path") or f"{entry.get('model')} at {entry.get('url')}"
        print(f"{name}  {where}{mark}")
    print(f"registry: {reg.path}", file=sys.stderr)
    return 0


def cmd_fetch_demo(args: argparse.Namespace) -> int:
    from .loading.demo import ensure_demo

    print(ensure_demo(progress=True))
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from .testing import make_tiny_weights

    print(make_tiny_weights(args.arch, Path(args.directory), seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen38", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="answer one prompt, streaming")
    p.add_argument("model", help="registry name (e.g. qwen38-demo) or path")
    p.add_argument("prompt", help="the prompt, or - to read stdin")
    _add_generation_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat; the session stays hot between turns")
    p.add_argument("model")
    _add_generation_flags(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible chat endpoint (all ranks under mlx.launch)",
    )
    p.add_argument("model", help="registry name (e.g. qwen38-demo) or path")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (rank 0)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument("--dtype", default=None, help="compute dtype: float32, bfloat16, float16")
    p.add_argument(
        "--sessions", type=int, default=2, help="live conversations kept in memory (LRU)"
    )
    p.add_argument(
        "--max-queue", type=int, default=16, help="calls that may wait; more are refused (503)"
    )
    p.add_argument("--quiet", action="store_true", help="do not log each HTTP request")
    _add_engine_flags(p)  # server-wide defaults; a request's own options override them
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", help="architecture, parameters, dtype, bytes, context")
    p.add_argument("model")
    p.add_argument("--context", type=int, default=None, help="print the memory plan for N tokens")
    p.add_argument(
        "--ranks", type=int, default=1, help="plan one rank of the model split over N ranks"
    )
    _add_kv_flags(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("add", help="register weights under a name (shared with `llm qwen38`)")
    p.add_argument("path", nargs="?", help="model directory (HF or MLX layout) or .gguf file")
    p.add_argument("--url", default=None, help="instead: a `qwen38 serve` server's URL")
    p.add_argument("--model", default=None, help="with --url: which served model")
    p.add_argument("--name", "-n", default=None, help="default: the directory or file name")
    p.add_argument("--default", action="store_true", help="also make it the default model")
    p.set_defaults(func=cmd_add)

    p = sub.add_parser("models", help="list registered models")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("fetch-demo", help="download and verify the demo model")
    p.set_defaults(func=cmd_fetch_demo)

    p = sub.add_parser("make-tiny", help="write random tiny weights for tests")
    p.add_argument("arch", choices=["qwen3_5", "qwen4_exp", "llama", "qwen2", "qwen3"])
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Qwen38Error as exc:
        print(f"qwen38: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
