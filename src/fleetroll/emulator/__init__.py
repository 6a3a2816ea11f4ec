"""An embedded Fleet-compatible platform: control plane, MCP servers, faults.

The real ``fleet-python`` SDK talks to it unchanged, so anything that works on
the emulator works on Fleet. See :class:`Emulator`.

Names are imported on first use: code that only needs a :class:`FaultProfile`
(the settings do) does not load the servers (starlette, uvicorn, mcp).
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from fleetroll.emulator.faults import FaultProfile, Latency
    from fleetroll.emulator.ledger import Ledger
    from fleetroll.emulator.server import Emulator

__all__ = ["Emulator", "FaultProfile", "Latency", "Ledger"]

_WHERE: dict[str, str] = {
    "Emulator": "fleetroll.emulator.server",
    "FaultProfile": "fleetroll.emulator.faults",
    "Latency": "fleetroll.emulator.faults",
    "Ledger": "fleetroll.emulator.ledger",
}


def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value
