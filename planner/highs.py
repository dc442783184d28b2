"""PuLP's HiGHS solver, without its banner.

highspy 1.16 prints a two-line banner on stdout the first time a process makes a `Highs()`,
before any option can turn its output off (PuLP's `msg=False` sets `output_flag` afterwards).
A plan written to stdout, and every command's output, must not carry it: the first `Highs()` is
made here with stdout pointed at /dev/null, and later ones print nothing.
"""
from __future__ import annotations

import functools
import os
import sys

import pulp


@functools.cache
def _silence_banner() -> None:
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solver(**options) -> pulp.HiGHS:
    """`pulp.HiGHS(msg=False, **options)`, its banner never shown."""
    _silence_banner()
    return pulp.HiGHS(msg=False, **options)
