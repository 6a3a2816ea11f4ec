"""An embedded Fleet-compatible platform: control plane, MCP servers, faults.

The real ``fleet-python`` SDK talks to it unchanged, so anything that works on
the emulator works on Fleet. See :class:`Emulator`.
"""

from fleetroll.emulator.faults import FaultProfile, Latency
from fleetroll.emulator.ledger import Ledger
from fleetroll.emulator.server import Emulator

__all__ = ["Emulator", "FaultProfile", "Latency", "Ledger"]
