"""A drafter cannot work with the configuration it was given (the engine reports it as a
ConfigError naming the same field)."""


class DrafterConfigError(ValueError):
    def __init__(self, field: str, value: object, problem: str, fix: str = "") -> None:
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        super().__init__(f"{field} = {value!r}: {problem}" + (f"; {fix}" if fix else ""))
