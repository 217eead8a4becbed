"""The thin front: ``kvsim <command> ...``. Each command lives in ``kvsim/commands/<name>.py``
with ``HELP`` (one line), ``add_parser(subparsers)`` and ``run(args) -> int``; the logic lives in
the library. Only the command being run builds its full parser, so ``kvsim --help`` and a
command's start load no tensor or plotting code they do not need.

User errors (:class:`KvsimError`) print one line on stderr and exit with status 2. Every plain
``int`` flag is a whole number >= 0 and every plain ``float`` flag finite (:mod:`kvsim.checks`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import kvsim.commands
from kvsim import __version__
from kvsim.checks import checked_flags
from kvsim.errors import KvsimError

DESCRIPTION = ("Capacity planner for long-context LLM serving with the KV cache partly in host "
               "memory: measure a machine, run KV policies on real attention, simulate serving.")
WORKFLOW = """a typical session:
  kvsim catalog                                    GPUs and models known, with sources
  kvsim replay --policy dense-offload --gpu h100-sxm --model qwen3-4b --context 32768
  kvsim plan --gpu h100-sxm,h200 --model qwen3-4b --context 8192,32768 \\
      --policy dense-offload,verkv --sink 4 --local 4 --batch 1,4,16 --out plan/
  kvsim policies verkv                             VerKV's options (kvsim policies: every policy)
  kvsim profile --gpu 0 --out traces/mygpu.npz     then: kvsim replay traces/mygpu.npz ...

'kvsim COMMAND --help' explains each command."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's; in a command that takes policy specs, a policy's own option given as
        a flag (``--sketch perfect``) is refused first, naming the spec that says it."""
        if getattr(self, "policy_spec_flags", False):
            from kvsim.commands._policy_flags import moved_flag
            argv = sys.argv[1:] if args is None else list(args)
            moved = moved_flag(argv, self._option_string_actions)
            if moved:
                self.error(moved)
        return super().parse_known_args(args, namespace)


def commands() -> list[str]:
    """Command names: the modules of kvsim/commands, underscores written as dashes."""
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(kvsim.commands.__path__)
                  if not m.name.startswith("_"))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the command named in ``argv`` (if any) gets its full set of options."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = _Parser(prog="kvsim", description=DESCRIPTION, epilog=WORKFLOW,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvsim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in commands():
        mod = importlib.import_module(f"kvsim.commands.{name.replace('-', '_')}")
        if name == chosen:
            mod.add_parser(sub)
            checked_flags(sub.choices[name])
        else:
            sub.add_parser(name, help=mod.HELP)
    return parser


MODEL_PACKAGES = ("torch", "transformers", "gguf", "accelerate", "sentencepiece")
MODEL_INSTALL = 'pip install torch==2.13.0 -e ".[model]"'


def _needs_model(e: ModuleNotFoundError, command: str) -> int:
    """A command that needs the ``model`` extra without it: one line and exit 2."""
    if (e.name or "").split(".")[0] not in MODEL_PACKAGES:
        raise e
    print(f"kvsim {command}: error: this needs {e.name.split('.')[0]}, which is not installed "
          f"(the 'model' extra): {MODEL_INSTALL}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as e:  # --help, --version, a bad flag (one line printed): its status
        return e.code or 0
    except ModuleNotFoundError as e:
        return _needs_model(e, next((a for a in argv if not a.startswith("-")), ""))
    try:
        return args.run(args) or 0
    except ModuleNotFoundError as e:
        return _needs_model(e, args.command)
    except KvsimError as e:
        print(f"kvsim {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvsim {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (kvsim catalog | head): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
