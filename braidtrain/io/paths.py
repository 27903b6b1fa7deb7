"""The paths a command writes and reads, checked before its work starts: a run that trains for an
hour and then finds its output path a file, or a folder it cannot write, has lost the hour. Each
check is a UserError whose one line names the flag, the path and what to change.

Writability is tried, not asked: os.access says yes to root on a read-only filesystem, so a check
creates (and removes) a small file where the output will go.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from braidtrain.errors import UserError


def _existing_ancestor(p: Path) -> Path:
    q = p.absolute()
    while not q.exists() and q != q.parent:
        q = q.parent
    return q


def _try_write(folder: Path, flag: str, path) -> None:
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".braidtrain-probe-")
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write in {folder} ({e.strerror or e}): give a path you can write "
                        f"to") from None
    os.close(fd)
    os.unlink(name)


def out_dir(path, flag: str) -> Path:
    """A folder the command writes into, made if missing (with its parents): an existing folder it
    can write in, or a path under one."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder: give a folder (made if missing)")
    q = _existing_ancestor(p)
    if not q.is_dir():
        raise UserError(f"{flag} {path}: {q} is a file, so no folder can be made under it: give another path")
    _try_write(q, flag, path)
    return p


def out_file(path, flag: str) -> Path:
    """A file the command writes (replacing it if there): not a folder, in a folder that exists
    and that it can write in."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file name in it, e.g. {p / 'out'}{p.suffix}")
    parent = p.absolute().parent
    if not parent.exists():
        raise UserError(f"{flag} {path}: the folder {parent} does not exist: create it, or give another path")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a folder: give another path")
    if p.exists():
        try:
            with open(p, "ab"):
                pass
        except OSError as e:
            raise UserError(f"{flag} {path}: cannot write it ({e.strerror or e}): give a path you can write "
                            f"to") from None
    else:
        _try_write(parent, flag, path)
    return p


def in_file(path, flag: str) -> Path:
    """A file the command reads: there, a file, readable, not empty."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{flag} {path}: no such file")
    if p.is_dir():
        raise UserError(f"{flag} {path} is a folder, not a file")
    try:
        with open(p, "rb") as f:
            empty = not f.read(1)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if empty:
        raise UserError(f"{flag} {path} is empty")
    return p


def in_dir(path, flag: str) -> Path:
    """A folder the command reads: there, and a folder."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{flag} {path}: no such folder")
    if not p.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder")
    return p
