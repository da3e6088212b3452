"""Results of the chaos suite (CONTRACT.md, "ScenarioResult"). Minimal stand-in written by the
netns part; the core's version replaces it (same fields)."""
import collections
from dataclasses import dataclass, field


@dataclass
class Fault:
    kind: str
    detail: str
    t: float = 0.0


@dataclass
class ScenarioResult:
    name: str
    seed: int
    description: str
    faults: collections.Counter = field(default_factory=collections.Counter)
    restarts: int = 0
    verified: collections.Counter = field(default_factory=collections.Counter)
    restore_sources: collections.Counter = field(default_factory=collections.Counter)
    digest_equal: "bool | None" = None
    loss_ok: "bool | None" = None
    problems: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self):
        return not self.problems and bool(self.digest_equal or
                                          (self.digest_equal is None and self.loss_ok))
