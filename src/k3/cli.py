"""`k3 <command>`: one entry point; each part of k3 registers its subcommands from its own `cli.py`.

A part's `register(subparsers)` adds parsers whose `func(args) -> int | None` does the work. Errors that
are the user's (bad config, bad input) are `ValueError`s: printed in one line, exit code 2, no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# Parts that contribute subcommands; a part whose optional dependencies are missing is skipped.
PARTS = [
    "k3.model.cli",
    "k3.data.cli",
    "k3.train.cli",
    "k3.io.cli",
    "k3.quant.cli",
    "k3.serve.cli",
    "k3.plan.cli",
    "k3.parallel.cli",
    "k3.agentenv.cli",
    "k3.distill.cli",
    "k3.ablate.cli",
    "k3.rl.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in PARTS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name or (e.name and name.startswith(e.name)):
                continue  # that part does not exist yet / is not installed
            raise
        module.register(sub)
    return parser


# string options for which an empty value means something: a prompt, torch.compile off, `k3 serve --host ""` (every
# interface, IPv4 and IPv6), a layer pattern left to mla_every. The others name paths, models, lists, ...
EMPTY_ALLOWED = {"prompt", "compile", "host", "layer_pattern"}


def _chosen(parser: argparse.ArgumentParser, func) -> argparse.ArgumentParser | None:
    """The (sub)parser whose command `func` is."""
    if parser._defaults.get("func") is func:
        return parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                found = _chosen(sub, func)
                if found is not None:
                    return found
    return None


def check_empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argument of the command given as "" (an unset shell variable: `--data "$DATA"`) is an error, not a silent
    "." for a path or a default in disguise."""
    chosen = _chosen(parser, getattr(args, "func", None)) or parser
    for a in chosen._actions:
        if not isinstance(a, argparse._StoreAction) or a.type not in (None, str) or a.nargs is not None \
                or a.const is not None or a.dest in EMPTY_ALLOWED or getattr(args, a.dest, None) != "":
            continue
        if a.option_strings:
            flag = a.option_strings[-1]
            raise ValueError(f"{flag} is empty (an unset shell variable?); give it a value, or drop {flag} to use "
                             "its default")
        raise ValueError(f"the {a.metavar or a.dest.upper()} argument is empty (an unset shell variable?); give it")


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe or socket whose reading end is closed (poll reports POLLERR, for a socket POLLHUP,
    on the writing end). A flush
    cannot tell: the failed write that raised has already dropped the buffered text, so a second flush succeeds."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))  # pipes | sockets
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output)
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    # third-party import-time notices that say nothing about the command (torchao's CUDA-only kernels cannot load
    # on a CPU build; torch's pytree deprecation notes about torchao's enums)
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_empty_values(parser, args)
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError as e:  # `k3 ... | head`: the reader has what it wanted, if it was stdout that broke
        if _stdout_reader_gone():
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return 0
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)  # another pipe (a worker, a socket)
        return 1
    except (ValueError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError,
            FileExistsError) as e:  # a bad path given on the command line: its message names the path
        hint = "; a path given as a directory is a file (or the reverse): pass another one" \
            if isinstance(e, (NotADirectoryError, IsADirectoryError, FileExistsError)) else ""
        print(f"k3 {args.command}: error: {e}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a loop that knows how to continue says so in the exception
        print(f"k3 {args.command}: interrupted" + (f": {e}" if str(e) else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
