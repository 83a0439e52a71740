"""Where a command may write: never into its own inputs, never over what it did not create.

Every command that writes (prepare, export, tiny_model, the download scripts, the trainer's
output_dir) asks `claim_output` before it writes anything:
  - the output may not be, contain, or lie inside any of the command's inputs (an export
    whose --out is its --base would replace the base weights with the merged ones);
  - an existing output is refused unless the user passes --force (an empty directory holds
    nothing to lose);
  - even with --force, only an output this command wrote before is replaced: the command
    says how it recognises its own (`ours`), usually the marker `mark_written_by` leaves.
A directory output is then written through `staged_directory`, a file through `staged_file`,
so it appears only when complete. (The trainer's output_dir has its own layout and checks: run_layout.py.)
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from utils.interrupts import stop_signals_unwind

MARKER = ".written_by"


class OutputConflict(ValueError):
    """An output that would overwrite an input or something the command did not write, or whose
    name the file system would refuse."""


def overlaps(a: str | Path, b: str | Path) -> bool:
    """Whether one of two paths is the other or lies inside it (symlinks resolved)."""
    a, b = Path(a).resolve(), Path(b).resolve()
    return a == b or a in b.parents or b in a.parents


def mark_written_by(directory: str | Path, command: str) -> None:
    """Leave the marker by which `command` recognises this directory as its own output."""
    (Path(directory) / MARKER).write_text(command + "\n", encoding="utf-8")


def written_by(directory: str | Path, command: str) -> bool:
    marker = Path(directory) / MARKER
    try:
        return marker.read_text(encoding="utf-8").strip() == command
    except (OSError, UnicodeDecodeError):
        return False


def claim_output(out: str | Path, *, force: bool, command: str, inputs: Mapping[str, str | Path | None] = {},
                 ours: Callable[[Path], bool] | None = None, flag: str = "--out") -> None:
    """Raise OutputConflict unless `command` may write `out` (see the module's rules).
    inputs: {how the user named it (e.g. "--base"): path}; ours: recognises an earlier output
    of this command (default: its marker)."""
    out = Path(out)
    refuse_overlap(out, inputs, flag)
    refuse_unwritable_name(out, flag)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    if not force:
        raise OutputConflict(f"{flag} {out} already exists; pass --force to replace it, or choose another {flag}")
    ours = ours or (lambda path: path.is_dir() and written_by(path, command))
    if not ours(out):
        raise OutputConflict(f"{flag} {out} holds files that {command} did not write; --force replaces only an "
                             f"earlier output of {command}. Move them away yourself, or choose another {flag}")


def refuse_overlap(out: str | Path, inputs: Mapping[str, str | Path | None], flag: str = "--out") -> None:
    """Raise OutputConflict if `out` is, holds or lies inside one of `inputs` ({how the user named it: path})."""
    for name, path in inputs.items():
        if path and overlaps(out, path):
            raise OutputConflict(f"{flag} {out} overlaps {name} {path}: a command never writes into its own "
                                 f"inputs; choose another {flag}")


def refuse_unwritable_name(out: Path, flag: str = "--out") -> None:
    """Raise OutputConflict for a path the file system would refuse, before anything is created: a
    directory or file name over its NAME_MAX bytes (the staging name, longer than the output's own,
    included), or the whole over PATH_MAX. Otherwise the write fails at its end as an OSError, after
    the directories above it were made."""
    absolute = Path(os.path.abspath(out))
    existing = next(p for p in (absolute, *absolute.parents) if os.path.exists(p))  # False for a name too long
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):  # a file system that does not say: the write itself will tell
        return
    staging = staging_path(absolute)
    for name in (*absolute.relative_to(existing).parts[:-1], staging.name):
        if len(os.fsencode(name)) > name_max:
            what = "its staging name" if name == staging.name else "the directory name"
            raise OutputConflict(f"{flag} {out}: {what} {name[:40]}... is {len(os.fsencode(name))} bytes, and the "
                                 f"file system takes names of {name_max} bytes at most (the output is written as "
                                 f"{staging.name[:12]}... first): choose a shorter {flag}")
    if len(os.fsencode(str(staging))) >= path_max:
        raise OutputConflict(f"{flag} {out}: the path is {len(os.fsencode(str(staging)))} bytes with its staging "
                             f"name, over the file system's {path_max}: choose a shorter {flag}")


def make_parents(directory: Path) -> list[Path]:
    """Make `directory` and the directories above it that are missing; returns those made, the
    outermost first, for `remove_made` to take back if the output is never written."""
    missing = [p for p in (directory, *directory.parents) if not os.path.exists(p)][::-1]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def remove_made(made: list[Path]) -> None:
    """Remove the directories `make_parents` made, innermost first, where they are still empty."""
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:
            return  # something else was put there meanwhile: leave it, and the directories above it


STAGING_INFIX = ".partial-"


def staging_path(out: Path) -> Path:
    """Where `out` is built before it is put in place: beside it, hidden, named by this process."""
    return out.with_name(f".{out.name}{STAGING_INFIX}{os.getpid()}")


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove what a process that has died (SIGKILL, the OOM killer, a lost VM) staged for `out`:
    its pid is in the name. A live process's staging, or a name of another form, is left alone.
    Returns what was removed."""
    removed = []
    for path in out.parent.glob(f".{glob.escape(out.name)}{STAGING_INFIX}*"):
        pid = path.name.rpartition(STAGING_INFIX)[2]
        if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def staged_directory(out: str | Path) -> Iterator[Path]:
    """Build an output directory next to `out` and put it in place only when the block ends
    without an error: a crash, a full disk, a bad record, SIGTERM or SIGINT (utils/interrupts.py)
    leaves `out` as it was (an earlier output, already claimed with claim_output, is replaced at
    the very end), no staging directory and no directory made for it behind; a dead process's
    leftovers are removed first."""
    out = Path(out)
    staging = staging_path(out)
    with stop_signals_unwind():
        made = make_parents(out.parent)
        remove_stale_staging(out)
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir()
            yield staging
            if out.exists():
                shutil.rmtree(out)
            os.replace(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            remove_made(made)
            raise


@contextlib.contextmanager
def staged_file(out: str | Path) -> Iterator[Path]:
    """Write a file output next to `out` and put it in place only when the block ends without an
    error (as staged_directory does for a directory); a crash, SIGTERM or SIGINT leaves no partial
    file behind."""
    out = Path(out)
    staging = staging_path(out)
    with stop_signals_unwind():
        made = make_parents(out.parent)
        remove_stale_staging(out)
        try:
            yield staging
            os.replace(staging, out)
        except BaseException:
            staging.unlink(missing_ok=True)
            remove_made(made)
            raise
