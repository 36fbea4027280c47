"""Refusals in the OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error(status: int, message: str, *, param: str | None = None, code: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, or a 400 saying it is not."""
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not JSON ({e})", code="invalid_json") from None
