"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every refusal of the server is an ``APIError``; the app turns it into the JSON body (or, once a
stream has started, into an SSE ``error`` event), so a client always reads why.
"""

from __future__ import annotations

__all__ = ["APIError", "bad_request", "error_body", "param_path", "validation_error"]


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


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def param_path(loc) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ``messages[0].role``. The request's
    ``body`` prefix and the members a union tried (``str``, ``list[str]``, a model's class name)
    are left out."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "body" and not path:
            continue
        elif not part.isidentifier() or part[:1].isupper() or part in _TYPE_NAMES:
            continue
        else:
            path += f".{part}" if path else part
    return path or None


def _code(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind in ("json_invalid", "model_attributes_type"):
        return "invalid_json"
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "is_instance_of":
        return "invalid_type"
    return "invalid_value"


def validation_error(errors) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors as OpenAI's 400, naming the parameter.
    An error a genfn validator raised carries its own code and parameter (``schemas.refuse``)."""
    # Of the errors the members of a union gave (``"stop": ["a", 1]`` is neither a string nor a list
    # of strings), the deepest names the value at fault.
    ranked = sorted(errors or (), key=lambda e: -len(e.get("loc") or ()))
    error = dict(ranked[0]) if ranked else {"type": "value_error", "loc": (), "msg": "invalid request"}
    kind = error.get("type", "value_error")
    ctx = error.get("ctx") or {}
    loc = tuple(error.get("loc") or ())
    own = ctx.get("param")
    if isinstance(own, str):
        param = param_path(loc + tuple(p for p in own.split(".") if p))
        return APIError(error.get("msg", "invalid request"), status=400, param=param, code=kind)
    param = param_path(loc)
    code = _code(kind)
    if code == "invalid_json":
        message = ("The request body must be a JSON object" if kind == "model_attributes_type"
                   else f"We could not parse the JSON body of your request: {error.get('msg', '')}")
        return APIError(message, status=400, param=None, code="invalid_json")
    if code == "unknown_parameter":
        where = param_path(loc[:-1])
        name = str(loc[-1]) if loc else "?"
        param = f"{where}.{name}" if where else name
        return APIError(f"Unrecognized request argument supplied: {param}", status=400, param=param, code=code)
    if code == "missing_required_parameter":
        return APIError(f"Missing required parameter: '{param}'", status=400, param=param, code=code)
    message = error.get("msg", "invalid value")
    what = "type" if code == "invalid_type" else "value"
    received = error.get("input")
    shown = repr(received) if isinstance(received, (int, float, str, bool)) and len(repr(received)) < 80 else None
    suffix = f", got {shown}" if shown is not None else ""
    return APIError(f"Invalid {what} for '{param}': {message}{suffix}", status=400, param=param, code=code)
