"""A world's state and the moves between states, in one place.

```
stopped ──start──► starting ──ready──► healthy ◄──healed── needs healing
   ▲                  │                  │  └──group broke──►   │
   │                  └─failed─► stopped │                      │
   └───────stop────── broken ◄──rank died┴──────rank died───────┘
```
Any state can be stopped. `broken` means a rank's process is gone: only a stop (or a
restart, which stops first) leaves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..wire.results import Death


class WorldState(str, Enum):
    """Where a world is in its life (compares equal to its lower-case name)."""

    STOPPED = "stopped"
    STARTING = "starting"
    HEALTHY = "healthy"
    NEEDS_HEALING = "needs healing"  # a cell broke the process group; the ranks' state is intact
    BROKEN = "broken"  # a rank's process died

    def __str__(self) -> str:
        return self.value


_MOVES: dict[WorldState, frozenset[WorldState]] = {
    WorldState.STOPPED: frozenset({WorldState.STARTING}),
    WorldState.STARTING: frozenset({WorldState.HEALTHY}),
    WorldState.HEALTHY: frozenset({WorldState.NEEDS_HEALING, WorldState.BROKEN}),
    WorldState.NEEDS_HEALING: frozenset({WorldState.HEALTHY, WorldState.BROKEN}),
    WorldState.BROKEN: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the state diagram does not have: a bug in this package, never a user mistake."""


class WorldLifecycle:
    """The current state, the dead ranks of a broken world, and the only way to change them."""

    def __init__(self) -> None:
        self.state = WorldState.STOPPED
        self.dead: dict[int, Death] = {}  # rank -> how its process ended (broken worlds)

    def __repr__(self) -> str:
        return f"<WorldLifecycle {self.state.value}>"

    def move(self, target: WorldState) -> None:
        if target is WorldState.STOPPED:  # a stop is always possible
            self.state, self.dead = target, {}
            return
        if target is self.state and target is not WorldState.STARTING:
            return  # e.g. a second cell breaking a group that already needs healing
        if target not in _MOVES[self.state]:
            raise IllegalTransition(f"a world cannot go from {self.state.value} to {target.value}")
        self.state = target

    def starting(self) -> None:
        self.move(WorldState.STARTING)

    def ready(self) -> None:
        self.move(WorldState.HEALTHY)

    def group_broke(self) -> None:
        self.move(WorldState.NEEDS_HEALING)

    def healed(self) -> None:
        self.move(WorldState.HEALTHY)

    def ranks_died(self, dead: Mapping[int, Death]) -> None:
        self.move(WorldState.BROKEN)
        self.dead.update(dead)

    def stopped(self) -> None:
        self.move(WorldState.STOPPED)

    @property
    def running(self) -> bool:
        """Processes exist (whatever their health)."""
        return self.state is not WorldState.STOPPED
