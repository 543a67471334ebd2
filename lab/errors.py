"""The few exception types the lab raises at its edges (data, loaders, CLI, backends)."""


class LabError(Exception):
    """Base class: an error the user can fix, with a message that says how."""


class InputError(LabError, ValueError):
    """A user input (file, parameter) is missing or malformed; the message names it and the fix."""


class WeightsError(LabError):
    """Model weights could not be found or do not match the architecture."""


class BackendUnavailable(LabError, RuntimeError):
    """An acceleration backend cannot run here (not installed, wrong GPU); the message says why."""
