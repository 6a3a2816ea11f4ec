"""What a verifier's result counts as: the one reader every path uses (docs/tasks.md, "Rewards").

Fleet's verifiers return their reward in several shapes, and so may an
``mcp`` task's verifier (a tool's answer, a line it prints, a file it writes):

* a number, kept as it is (no clamp: 1.5 stays 1.5), if it is finite;
* a boolean: ``True`` is 1.0, ``False`` 0.0;
* an object (a dict) with ``score``, ``reward`` or ``value`` (the first of
  those it has, in that order), itself a finite number or a boolean.

Anything else (a string, NaN, an object without those keys, None...) is no
reward: :func:`verifier_reward` raises :class:`ValueError` whose message says
what the verifier returned (shortened), for the rollout's ``verifier_error``.
:func:`verifier_reward_text` reads the same shapes from text (a printed line,
a reward file). The Fleet verifier (direct and SDK control clients alike, on
Fleet or the emulator), the ``mcp`` provider and ``fleetroll rescore`` all read
through here, so one result means one reward wherever it was computed.
Pure functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Final

__all__ = ["REWARD_KEYS", "verifier_reward", "verifier_reward_text"]

#: The keys of a dict result that hold its reward, in the order they are looked for.
REWARD_KEYS: Final = ("score", "reward", "value")
_NAMES: Final = "'score', 'reward' or 'value'"
#: How much of an unreadable result an error message shows.
_SHOWN: Final = 80


def verifier_reward(result: object) -> float:
    """The reward a verifier's result stands for (see the module's docstring).

    Raises:
        ValueError: the result is none of the shapes a reward takes; the
            message names what it is (its type and a shortened ``repr``).
    """
    if isinstance(result, Mapping):
        key = next((k for k in REWARD_KEYS if k in result), None)
        if key is None:
            keys = ", ".join(repr(str(k))[:40] for k in list(result)[:5]) or "none"
            raise ValueError(
                f"the verifier returned a dict without {_NAMES} (its keys: {keys})"[:300]
            )
        try:
            return _number(result[key])
        except ValueError as exc:
            raise ValueError(f"the verifier's {key!r} is {exc}") from None
    try:
        return _number(result)
    except ValueError as exc:
        raise ValueError(f"the verifier returned {exc}") from None


def verifier_reward_text(text: str) -> float:
    """The reward a verifier's text stands for: a number (``0.5``, ``1e-3``),
    ``true``/``false`` (any case), or a JSON object read by :func:`verifier_reward`.

    Raises:
        ValueError: the text is none of those, or names no finite reward.
    """
    stripped = text.strip()
    if stripped.lower() in ("true", "false"):
        return verifier_reward(stripped.lower() == "true")
    try:
        number = float(stripped)
    except ValueError:
        pass
    else:
        return verifier_reward(number)
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except (ValueError, RecursionError):
            pass
        else:
            return verifier_reward(value)
    raise ValueError(f"the verifier wrote {_shown(stripped)}, not a reward")


def _number(value: object) -> float:
    """``value`` as a reward, or ValueError naming it ("'abc' (a str), not a ...")."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.inf
        if math.isfinite(number):
            return number
        raise ValueError(f"{_shown(value)}, not a finite number")
    raise ValueError(
        f"{_shown(value)} ({_kind(value)}), not a number, a boolean or a dict with {_NAMES}"
    )


def _kind(value: object) -> str:
    name = type(value).__name__
    return "None" if value is None else f"a{'n' if name[:1] in 'aeiou' else ''} {name}"


def _shown(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # a verifier's object whose repr fails is still named
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"
