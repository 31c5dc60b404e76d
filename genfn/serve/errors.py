"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every refusal of the server is an ``APIError``; the app turns it into the JSON body (or, once a
stream has started, into an SSE ``error`` event), so a client always reads why.
"""

from __future__ import annotations

__all__ = ["APIError", "bad_request", "error_body"]


class APIError(Exception):
    """A request the server refuses or could not serve, with OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(message, status=400, param=param, code=code)
