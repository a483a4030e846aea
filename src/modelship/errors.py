"""The error every stage and release command raises for a job it could not do; the CLI
prints its message as one line. Shared, so the release and fleet code below or beside the
pipeline need not import it."""


class PipelineError(Exception):
    """A stage could not do its job; the message is a one-line reason naming the input."""
