"""The admin credential as the operator's routes (router/admin.py, router/status_page.py) take it.

A browser cannot send a Bearer token from its address bar, so the operator's routes also take
HTTP Basic auth whose password is the admin token (any user name): a 401 names the realm and the
browser asks once, then sends the credential with the page's own requests. Basic is accepted for
reads (GET) only: a browser attaches it to any request for this origin, a cross-site form's
POST included, so it must never authorize anything that acts. The token never goes in a URL.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from fastapi import Request
from fastapi.responses import JSONResponse

from router.errors import Unauthorized
from security.credentials import ClusterCredentials, bearer_matches

REALM = "pdcluster"
READ_METHODS = frozenset({"GET"})


class AdminCredentialRequired(Unauthorized):
    """401 with a Basic challenge, so that a browser asks for the admin token."""

    def response(self) -> JSONResponse:
        answer = super().response()
        answer.headers["WWW-Authenticate"] = f'Basic realm="{REALM}", charset="UTF-8"'
        return answer


def basic_password_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header is Basic auth whose password is `token`, any user name
    (constant time in the password)."""
    scheme, _, encoded = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    _, colon, password = decoded.partition(b":")
    return bool(colon) and hmac.compare_digest(password, token.encode())


def admin_credential_matches(request: Request, token: str) -> bool:
    """The admin token as Bearer (any method) or as a Basic password (reads only)."""
    authorization = request.headers.get("authorization")
    if bearer_matches(authorization, token):
        return True
    return request.method in READ_METHODS and basic_password_matches(authorization, token)


def require_admin(credentials: ClusterCredentials):
    """A FastAPI dependency that lets only holders of the admin token through."""

    def admin_only(request: Request) -> None:
        if not admin_credential_matches(request, credentials.admin_token):
            raise AdminCredentialRequired("this endpoint needs the cluster's admin token")

    return admin_only
