"""Results of the chaos suite: one Fault, one ScenarioResult per scenario, the Summary."""
import collections
import dataclasses
import time


@dataclasses.dataclass
class Fault:
    """One injected fault: its kind, the injector's one-line detail, when (seconds since the
    scenario's start) and the launch round it hit."""
    kind: str
    detail: str
    at: float
    launch: int = 0


@dataclasses.dataclass
class ScenarioResult:
    name: str
    seed: int
    description: str                    # enough to rerun: chaos.py --seed S --scenario NAME
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    restarts: int = 0                   # group launches - 1, all agents
    verified: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    restore_sources: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    digest_equal: "bool | None" = None  # None when a W outside 1, 2, 4 ran
    loss_ok: "bool | None" = None       # the tolerance check for the others
    problems: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    log: list = dataclasses.field(default_factory=list)    # the injected faults (Fault)
    notes: list = dataclasses.field(default_factory=list)  # observations that are not failures
    work: str = ""                      # its work folder (kept when it failed or --keep)

    @property
    def ok(self):
        return not self.problems and (self.digest_equal is True or
                                      (self.digest_equal is None and self.loss_ok is True))


class Summary:
    """All scenarios of one driver run; table() renders CONTRACT.md "Output"."""

    def __init__(self, seed, kinds):
        self.seed, self.kinds = seed, list(kinds)
        self.results = []
        self.t0 = time.monotonic()

    def add(self, r):
        self.results.append(r)

    def total(self, attr):
        c = collections.Counter()
        for r in self.results:
            c.update(getattr(r, attr))
        return c

    def table(self):
        faults = self.total("faults")
        rows = [("kind", "injected")] + [(k, str(faults.get(k, 0))) for k in self.kinds]
        rows += [(k, str(v)) for k, v in sorted(faults.items()) if k not in self.kinds]
        w = max(len(a) for a, _ in rows)
        out = [f"{a:<{w}} | {b}" for a, b in rows[:1]] + ["-" * w + "-+-" + "-" * 8]
        out += [f"{a:<{w}} | {b}" for a, b in rows[1:]]
        fmt = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"
        digests = [r.digest_equal for r in self.results]
        out += [
            f"scenarios: {len(self.results)} ({sum(r.ok for r in self.results)} ok) in "
            f"{time.monotonic() - self.t0:.0f} s",
            f"restarts: {sum(r.restarts for r in self.results)}",
            f"snapshots verified: {fmt(self.total('verified'))}",
            f"restore sources: {fmt(self.total('restore_sources'))}",
            f"seed: {self.seed}",
            f"faults={sum(faults.values())}",
            "digest_equal=" + ("yes" if self.results and all(d is not False for d in digests)
                               and any(d is True for d in digests) else "no"),
        ]
        return "\n".join(out)
