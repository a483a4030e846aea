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


class OverloadedError(APIError):
    status_code = 429
    error_type = "rate_limit_error"

    @property
    def code(self) -> str:
        return "engine_overloaded"


class UnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"
