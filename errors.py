"""The one error type tensorstow raises for bad input, and the check of an output path every
command makes before its work. Every layer imports them from here."""
import tempfile
from pathlib import Path


class TensorstowError(ValueError):
    """Bad input from a user: a message that names the problem and how to fix it."""


class Interrupted(Exception):
    """The user stopped a run (Ctrl-C) and it stopped at a safe point: a message saying where,
    what is committed and how to go on. The command exits 130, as a shell reports SIGINT."""


def check_writable(path, flag: str) -> None:
    """Refuse, before any work, an output `path` (given as `flag`) whose directory this user cannot
    write a file in: the work would end without its output."""
    try:
        with tempfile.TemporaryFile(dir=Path(path).parent):
            pass
    except OSError as e:
        raise TensorstowError(f"{flag} {path}: cannot write a file in its directory ({e.strerror or e}); pass a "
                              f"path this user can write") from None
