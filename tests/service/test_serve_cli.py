"""``fleetroll serve``'s options: checked by click before anything starts."""

from __future__ import annotations

from click.testing import CliRunner

from fleetroll.cli.main import main


def test_a_serve_port_out_of_range_is_a_usage_error_without_a_traceback() -> None:
    result = CliRunner().invoke(main, ["serve", "--port", "99999"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "Invalid value for '--port': 99999 is not in the range 0<=x<=65535" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
