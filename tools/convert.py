"""``earlyfuse-convert``: checkpoints in and out of training runs, one subcommand per module
(``tools/convert_<name>.py`` for each name in ``SUBCOMMANDS``: its ``DESCRIPTION``, ``EXAMPLES``,
``add_arguments(parser)`` and ``run(args)``; only the command run is imported: torch and all). Errors that users cause (a missing
file, a truncated checkpoint, a mismatch, a folder that cannot be written) are one line naming
the file, exit code 2; other OSErrors (a full disk) one line, exit code 1.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from data.cli.common import USER_ERRORS

SUBCOMMANDS = {
    "release": "a DeepSpeed checkpoint (any ZeRO stage) -> a portable release folder",
    "import": "validate a release and print the earlyfuse-train command that starts a run from it",
    "hf": "a release -> a Hugging Face model (Qwen3 architecture), where the architecture maps",
    "universal": "a ZeRO 1-2 checkpoint -> a DeepSpeed universal checkpoint (resume on another world size)",
}

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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command's options; given ``argv``, only those of the command it names (imported)."""
    named = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    parser = argparse.ArgumentParser(
        prog="earlyfuse-convert",
        description="Convert earlyfuse checkpoints: DeepSpeed run -> release -> new run or Hugging Face.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        command_parser = sub.add_parser(
            name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if named in (None, name):
            module = importlib.import_module(f"tools.convert_{name}")
            command_parser.description, command_parser.epilog = module.DESCRIPTION, module.EXAMPLES
            module.add_arguments(command_parser)
            command_parser.set_defaults(run=module.run)
    return parser


def write_failure(out, error: Exception) -> OSError | None:
    """A full disk or a file-size limit that stopped writing OUT, in words, whoever raised it:
    an OSError saying so, safetensors' writer ("I/O error: ... (os error 28)", no OSError) or
    shutil's copy of a folder (a list of every file's error). Other OSErrors (write_folder's own
    "not replaced ...; the previous one is in ...") are said as they are."""
    from train.save_errors import write_failure_cause

    if isinstance(error, OSError) and not isinstance(error, shutil.Error):
        code = error.errno
    elif isinstance(error, ValueError):
        return None
    else:
        found = re.search(r"\[Errno (\d+)\]|\(os error (\d+)\)", str(error))
        code = found and int(found.group(1) or found.group(2))
    if code not in (errno.ENOSPC, errno.EFBIG):
        return None
    cause = write_failure_cause(Path(out), OSError(code, os.strerror(code)))
    return cause and type(cause)(f"{out} could not be written: {cause}; nothing was changed there")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # An option after the positionals (import's --config-dir after RELEASE RUN_DIR) ends the
    # overrides there for argparse; the words after it are overrides too.
    if extra and hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.run(args)
        return 0
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback, as earlyfuse-prep says it
        print(
            f"earlyfuse-convert {args.command}: interrupted; run the same command again",
            file=sys.stderr,
        )
        return 130
    except Exception as e:
        found = write_failure(args.out, e) if getattr(args, "out", None) else None
        if found is None and not isinstance(e, (ValueError, OSError)):
            raise
        # ReleaseError, CheckpointError: ValueErrors naming the file
        said = str(found or e)
        print(f"earlyfuse-convert {args.command}: error: {said}{live(args, said)}", file=sys.stderr)
        return 2 if isinstance(found or e, USER_ERRORS) else 1  # as earlyfuse-prep decides


def live(args, said: str) -> str:
    """What to add to an error reading the checkpoints of a run that is training now (one that
    names its run folder): its trainer writes and removes checkpoints while they are read (a
    file missing, a folder gone mid-read, a config not yet copied), which would otherwise read
    as a damaged checkpoint or a disk's fault."""
    from train.run_lock import holder_text, live_holder

    run_dir = getattr(args, "run_dir", None)
    if args.command not in ("release", "universal") or not run_dir or str(run_dir) not in said:
        return ""
    holder = live_holder(Path(run_dir))
    if holder is None:
        return ""
    here = holder.get("host") == socket.gethostname()
    return (
        f" ({run_dir} {'is' if here else 'may be'} training now: {holder_text(holder)}"
        f"{'' if here else ', a host this cannot check from here'}; its trainer writes "
        "checkpoints and removes older ones (train.keep_last) while this reads one: convert a "
        "checkpoint it keeps with --step, or after the run)"
    )


if __name__ == "__main__":
    sys.exit(main())
