"""Opening the dashboard behind a service token: a login URL and a cookie.

A browser cannot add an ``Authorization`` header to a page it opens, so the
dashboard has a login URL: ``GET /dashboard/login?token=<token>`` checks the
token in constant time, sets an ``HttpOnly``, ``SameSite=Strict`` cookie and
redirects to ``/dashboard``; the page's data requests then carry the cookie.
A wrong or missing token is a 401 with one line of text.

The cookie never holds the token: its value is an HMAC of a fixed label
keyed by the token, so it opens the dashboard's data and nothing else (the
guard accepts it only on :data:`COOKIE_PATHS`), and it stops working when the
token changes. Nothing here logs or echoes what the client sent.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping
from http.cookies import CookieError, SimpleCookie
from typing import Final

from pydantic import SecretStr
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

__all__ = ["COOKIE", "COOKIE_PATHS", "LOGIN_PATH", "cookie_authorizer", "login_route"]

COOKIE: Final = "fleetroll_dashboard"
LOGIN_PATH: Final = "/dashboard/login"
#: The only paths the cookie opens.
COOKIE_PATHS: Final = frozenset({"/dashboard/data"})
_LABEL: Final = b"fleetroll dashboard cookie v1"


def _secret(token: SecretStr) -> bytes:
    # Stripped, as the service's guard compares it.
    return token.get_secret_value().strip().encode()


def _cookie_value(token: SecretStr) -> str:
    return hmac.new(_secret(token), _LABEL, hashlib.sha256).hexdigest()


def cookie_authorizer(token: SecretStr | None) -> Callable[[str, Mapping[str, str]], bool] | None:
    """For the service's guard: whether a request to ``path`` carries the dashboard cookie.

    None without a token (nothing to log in to).
    """
    if token is None:
        return None
    expected = _cookie_value(token).encode()

    def authorized(path: str, headers: Mapping[str, str]) -> bool:
        if path not in COOKIE_PATHS:
            return False
        jar = SimpleCookie()
        try:
            jar.load(headers.get("cookie", ""))
        except CookieError:
            return False
        morsel = jar.get(COOKIE)
        return morsel is not None and secrets.compare_digest(morsel.value.encode(), expected)

    return authorized


def login_route(token: SecretStr | None) -> Route:
    """``GET /dashboard/login?token=``: the cookie for a right token, then the page."""

    async def login(request: Request) -> Response:
        page = RedirectResponse("../dashboard", status_code=303)
        page.headers["Cache-Control"] = "no-store"
        page.headers["Referrer-Policy"] = "no-referrer"
        if token is None:  # no token to check: the page is open
            return page
        given = request.query_params.get("token", "").strip().encode()
        if not secrets.compare_digest(given, _secret(token)):
            return PlainTextResponse(
                "wrong or missing token: open /dashboard/login?token=<FLEETROLL_SERVICE_TOKEN>\n",
                401,
                headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"},
            )
        page.set_cookie(
            COOKIE,
            _cookie_value(token),
            path=request.scope.get("root_path", "") + "/dashboard",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return page

    return Route(LOGIN_PATH, login, methods=["GET"])
