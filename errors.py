"""The one error type tensorstow raises for bad input. Every layer imports it from here."""


class TensorstowError(ValueError):
    """Bad input from a user: a message that names the problem and how to fix it."""


class Interrupted(Exception):
    """The user stopped a run (Ctrl-C) and it stopped at a safe point: a message saying where,
    what is committed and how to go on. The command exits 130, as a shell reports SIGINT."""
