"""Exceptions shared across the core; each message says what to do next."""


class MStarError(Exception):
    """Base class for every error M* raises on purpose."""


class GraphValidationError(MStarError):
    """A graph or walk is malformed; raised when the model is built, never at request time."""

    def __init__(self, message: str, *, walk: str | None = None, node: str | None = None):
        where = []
        if walk is not None:
            where.append(f"walk '{walk}'")
        if node is not None:
            where.append(f"node '{node}'")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message)
        self.walk = walk
        self.node = node


class ConfigError(MStarError):
    """A configuration file or settings mapping has an unknown key or a bad value."""


class ModelLoadError(MStarError):
    """A model cannot be served as built; raised while it loads, never at request time."""


class ModuleContractError(ModelLoadError, TypeError):
    """A node's module lacks a method its engine calls, or the method's signature cannot take the engine's call."""

    def __init__(self, message: str, *, node: str, engine: str, method: str | None = None):
        super().__init__(message)
        self.node = node
        self.engine = engine
        self.method = method


class RegistryLookupError(MStarError, KeyError):
    """A name was not found in a plugin registry; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class RequestError(MStarError):
    """A request was rejected or failed; `status` maps to an HTTP status code, `param` names the bad field."""

    status: int = 400
    param: str | None = None

    def __init__(self, message: str, *, status: int | None = None, param: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if param is not None:
            self.param = param


class NodeExecutionError(RequestError):
    """A node raised while running one request's invocation."""

    status = 500

    def __init__(self, node: str, request_id: str, cause: BaseException):
        super().__init__(f"node '{node}' failed for request {request_id}: {type(cause).__name__}: {cause}")
        self.node = node
        self.cause = cause
        if isinstance(cause, RequestError):  # an engine's rejection (e.g. 413) keeps its status and named field
            self.status = cause.status
            self.param = cause.param


class RequestCancelled(RequestError):
    """The request was cancelled by its caller."""

    status = 499


class RequestTimeout(RequestError):
    """The request ran past its deadline."""

    status = 504
