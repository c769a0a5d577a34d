"""``earlyfuse-convert``: checkpoints in and out of training runs, one subcommand per module
(``tools/convert_<name>.py`` for each name in ``SUBCOMMANDS``: its ``HELP``, ``DESCRIPTION``,
``EXAMPLES``, ``add_arguments(parser)`` and ``run(args)``). Errors that users cause (a missing
file, a truncated checkpoint, a mismatch, a folder that cannot be written) are one line naming
the file, exit code 2; other OSErrors (a full disk) one line, exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from data.cli.common import USER_ERRORS

SUBCOMMANDS = ("release", "import", "hf", "universal")

EPILOG = """\
examples:
  earlyfuse-convert release runs/demo/lm releases/demo           # latest checkpoint, fp32
  earlyfuse-convert release runs/demo/lm --step 800 releases/demo-800 --dtype bf16
  earlyfuse-convert import releases/demo runs/finetune experiment=demo optim.lr=1e-4
  earlyfuse-convert hf releases/demo hf/demo                     # transformers (Qwen3) format
  earlyfuse-convert universal runs/1b                            # then resume on another world size
  earlyfuse-generate releases/demo --prompt "def fib(n):"        # sample from a release

Run `earlyfuse-convert COMMAND --help` for each command's options. Formats: docs/checkpoints.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="earlyfuse-convert",
        description="Convert earlyfuse checkpoints: DeepSpeed run -> release -> new run or Hugging Face.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        command = importlib.import_module(f"tools.convert_{name}")
        command_parser = sub.add_parser(
            name,
            help=command.HELP,
            description=command.DESCRIPTION,
            epilog=command.EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
        return 0
    except (ValueError, OSError) as e:  # ReleaseError, CheckpointError: ValueErrors naming the file
        print(f"earlyfuse-convert {args.command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, USER_ERRORS) else 1  # as earlyfuse-prep decides


if __name__ == "__main__":
    sys.exit(main())
