"""Click options shared by several commands; imports nothing but click.

Kept apart from the modules that run the commands, so that building the
command line (``fleetroll --help``) loads none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

__all__ = ["ray_options"]

F = TypeVar("F", bound=Callable[..., Any])


def ray_options(command: F) -> F:
    """The options ``--ray [ADDRESS]`` and ``--ray-actors N`` of a click command.

    They reach the command as ``ray_address`` (None, ``"local"``, or an
    address) and ``ray_actors``.
    """
    command = click.option(
        "--ray-actors",
        type=click.IntRange(min=1),
        default=None,
        help="Ray actors, each running its own pool (with --ray) [default: one per CPU].",
    )(command)
    return click.option(
        "--ray",
        "ray_address",
        is_flag=False,
        flag_value="local",
        default=None,
        metavar="[ADDRESS]",
        help="Shard batches over Ray actors (a local Ray, or the cluster at ADDRESS).",
    )(command)
