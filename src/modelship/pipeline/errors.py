"""Typed errors of the pipeline stages; the CLI prints their message as one line."""

from modelship.errors import PipelineError


class AcquireError(PipelineError):
    """The model could not be acquired (bad source, unreachable Hub, corrupt file...)."""


class TransientError(PipelineError):
    """A failure worth retrying (a network hiccup, a worker that died); the DAG retries it."""


class HubUnavailableError(AcquireError, TransientError):
    """The Hub could not be reached or answered 429/5xx: retried by the DAG, and the CLI
    exits with the transient code (75) so an Argo Workflow retries the step."""
