"""The one error type tensorstow raises for bad input. Every layer imports it from here."""


class TensorstowError(ValueError):
    """Bad input from a user: a message that names the problem and how to fix it."""
