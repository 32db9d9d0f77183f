"""The samplers' error, in a module of its own: the CLI catches it without importing torch."""


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names field, value and fix."""
