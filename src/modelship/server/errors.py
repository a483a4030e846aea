"""Typed API errors; each maps to an OpenAI error body and an HTTP status."""

from __future__ import annotations


class APIError(Exception):
    """An error the client sees as `{"error": {message, type, param, code}}`."""

    status_code = 500
    error_type = "internal_error"

    def __init__(
        self, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def code(self) -> str | int | None:
        return self.error_type


class BadRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"

    @property
    def code(self) -> str:
        return "invalid_api_key"


class ModelNotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"

    @property
    def code(self) -> str:
        return "model_not_found"


class ConflictError(APIError):
    status_code = 409
    error_type = "invalid_request_error"

    @property
    def code(self) -> str:
        return "conflict"


class OverloadedError(APIError):
    status_code = 429
    error_type = "rate_limit_error"

    @property
    def code(self) -> str:
        return "engine_overloaded"


class RouteError(APIError):
    """The framework's own refusal of a request no route takes (unknown path: 404, a
    method the route lacks: 405); `detail` is its text for any other status."""

    error_type = "invalid_request_error"

    def __init__(
        self,
        status_code: int,
        method: str,
        path: str,
        detail: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        messages = {404: f"Invalid URL ({method} {path}).",
                    405: f"Method {method} is not allowed on {path}."}  # fmt: skip
        super().__init__(messages.get(status_code, detail), headers=headers)
        self.status_code = status_code

    @property
    def code(self) -> str | None:
        return {404: "not_found", 405: "method_not_allowed"}.get(self.status_code)


class UnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"
