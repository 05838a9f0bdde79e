"""The errors a user can fix. Each message says what was wrong and what to do about it."""


class AnatomyError(Exception):
    """Base class: the CLI prints these as one line, the server maps them to 4xx."""


class ModelNotFoundError(AnatomyError):
    """The model name or path resolves to nothing we can run."""


class UnsupportedModelError(AnatomyError):
    """A config we understand but cannot run (another model type, an unsupported feature)."""


class ConfigError(AnatomyError):
    """A config.json that is malformed or inconsistent."""


class WeightsError(AnatomyError):
    """A checkpoint with missing, unexpected, misshapen or unreadable tensors."""


class RequestError(AnatomyError):
    """A generation request that cannot be served as asked (bad sampling values, too long...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
