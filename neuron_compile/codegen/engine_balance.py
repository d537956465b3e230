"""Codegen stage: which compute engine runs each full-tile instruction of a tile scope.

Input: the instructions an emitter asks about, in emission order, each with its candidate engines and its cost
on each. Output: the engine argument of each instruction (VectorE, GpSimd or ScalarE). The cost model's schedule
runs independent instructions on all three at once, and the next tile's instructions beside this tile's, so a
scope's time is its busiest engine's share of the work: the balance spreads the work to keep that share small.

Two ways to decide. Online (``EngineBalance()``): each instruction goes to another engine once VectorE has more
of the scope's work than that engine would have with it, else to VectorE. Planned (``balance.planned()`` after an
online emission of the same scope): the instructions the online pass recorded are assigned longest first, each to
the engine that ends least loaded with it (the LPT rule for scheduling on unrelated machines; instructions with one
candidate engine first); a second emission of
the scope replays that plan. The online rule is blind to what comes later: AdamW's update put three small
instructions on VectorE, then both 8-cycle reciprocals had to share the rest unevenly.

An instruction its emitter can split by columns (``choose_split``: two instructions over the two parts of the
tile's columns) may then go to two engines: when the busiest engine runs it and another candidate ends lighter, the
plan moves the share of its columns that evens the two (in ``SPLIT_STEPS``ths of the columns). AdamW's update then
runs its 8-cycle reciprocal mostly on GpSimd and the rest on VectorE, where whole instructions left GpSimd the
heavier by most of a pass.

Relative costs of one tile, as the cost model charges them (runtime/simulator/cost.py): VectorE 1 per pass over
the elements (0.5 on bf16 tiles, its trn2 performance mode), GpSimd and ScalarE 0.8 (a faster clock, no bf16
mode); a tensor_tensor makes two passes unless it adds, subtracts or multiplies bf16 tiles or reads one operand
from PSUM; the ALU's reciprocal
8 and rsqrt 4. Instructions that touch PSUM (GpSimd cannot reach it) or (P, 1) row vectors stay on VectorE (work
on row vectors alone, one element per partition, weighs nothing); ScalarE takes casts and tensor_scalar multiplies
and / or adds only.
"""

from __future__ import annotations

GPSIMD = ", engine=nisa.engine.gpsimd"  # the engine argument of an instruction put on GpSimd
SCALAR = ", engine=nisa.engine.scalar"
ENGINE_ARGUMENTS = {"vector": "", "gpsimd": GPSIMD, "scalar": SCALAR}
FLOAT_TILE_DTYPES = ("float32", "bfloat16", "float16")
GPSIMD_COST = 0.8
SCALAR_COST = 0.8
# tensor_scalar stages trn2's ScalarE runs (nki-spec §1.3: (mul, add), (mul, None), (add, None))
SCALAR_STAGES = {("nl.multiply", "nl.add"), ("nl.multiply",), ("nl.add",)}
COPY = ("copy",)  # the stages of a cast (tensor_copy), which ScalarE runs too
SPLIT_STEPS = 32  # a split instruction's first part: a multiple of 1 / SPLIT_STEPS of the columns


class EngineBalance:
    """One scope's engine loads (in VectorE cycles per element) and its decisions; ``plan``: the engines a
    previous emission of the scope decided (``planned``), replayed in order."""

    def __init__(self, plan: list[str] | None = None):
        self.load = {"vector": 0.0, "gpsimd": 0.0, "scalar": 0.0}
        self.fixed = dict(self.load)  # work whose engine was not a choice
        self.choices: list[dict[str, float]] = []  # each choice's candidate engines and their costs, in order
        self.plan = plan
        self.lines: list[str] | None = None  # the scope's emitted lines, when the emitter shares them
        self.charges: list[tuple[int, float]] = []  # (lines emitted so far, cost) of every instruction charged
        self.expected: dict[str, float] = {}  # a planned balance: each engine's load once its plan is replayed
        self.splittable: set[int] = set()  # the choices whose instruction may be split by columns
        # a planned balance: choice -> (second engine, the first engine's share in SPLIT_STEPS) for a split one
        self.splits: dict[int, tuple[str, int]] = {}

    def _charge(self, engine: str, cost: float) -> None:
        self.load[engine] += cost
        self.charges.append((len(self.lines) if self.lines is not None else 0, cost))

    def note(self, engine: str, cost: float = 1.0) -> None:
        """Work that runs on ``engine`` whatever the balance says."""
        self._charge(engine, cost)
        self.fixed[engine] += cost

    @property
    def halfway_line(self) -> int:
        """The number of lines after which half of the charged work is issued (0 when nothing was charged)."""
        total, issued = sum(cost for _, cost in self.charges), 0.0
        for position, cost in self.charges:
            issued += cost
            if issued >= total / 2:
                return position + 1
        return 0

    def choose(self, costs: dict[str, float]) -> str:
        """The engine for an instruction costing ``costs[engine]`` on each engine it may run on (VectorE always
        among them): the plan's, when it has one for this instruction, else the online rule's."""
        planned = self.plan[len(self.choices)] if self.plan is not None and len(self.choices) < len(self.plan) else None
        self.choices.append(costs)
        engine = planned if planned in costs else self._online(costs)
        self._charge(engine, costs[engine])
        return engine

    def choose_split(self, costs: dict[str, float]) -> tuple[str, str | None, int]:
        """(first engine, second engine, the first's share of the columns in ``SPLIT_STEPS``ths) for an instruction
        its emitter can split by columns: the plan's split when it has one (the second engine then takes the
        other columns), else ``choose``'s engine for all of them (second engine None)."""
        index = len(self.choices)
        self.splittable.add(index)
        second, share = self.splits.get(index, (None, SPLIT_STEPS))
        if second is None:
            return self.choose(costs), None, SPLIT_STEPS
        first = self.plan[index]
        self.choices.append(costs)
        self._charge(first, costs[first] * share / SPLIT_STEPS)
        self._charge(second, costs[second] * (SPLIT_STEPS - share) / SPLIT_STEPS)
        return first, second, share

    def _online(self, costs: dict[str, float]) -> str:
        after = {engine: self.load[engine] + cost for engine, cost in costs.items() if engine != "vector"}
        engine = min(after, key=after.get, default=None)
        return "vector" if engine is None or after[engine] >= self.load["vector"] else engine

    def planned(self) -> EngineBalance:
        """A balance that replays, for a second emission of the same scope, the longest-first assignment of
        this one's choices on top of its fixed work."""
        loads = dict(self.fixed)
        plan = [""] * len(self.choices)
        # instructions with one candidate engine first (no choice: work as fixed as ``fixed``), then longest first
        order = sorted(range(len(self.choices)),
                       key=lambda i: (len(self.choices[i]) > 1, -max(self.choices[i].values())))
        for index in order:
            costs = self.choices[index]
            engine = min(costs, key=lambda name: (loads[name] + costs[name], name != "vector"))
            loads[engine] += costs[engine]
            plan[index] = engine
        balance = EngineBalance(plan)
        balance.splits = self._splits(plan, loads)
        balance.expected = loads
        return balance

    def _splits(self, plan: list[str], loads: dict[str, float]) -> dict[int, tuple[str, int]]:
        """The splittable choices of ``plan`` that move part of their columns off the busiest engine, each to the
        candidate that ends the lightest, by the share that evens the two (rounded down to a ``SPLIT_STEPS``th);
        ``loads`` updated."""
        splits = {}
        for index in sorted(self.splittable):
            costs, first = self.choices[index], plan[index]
            if loads[first] < max(loads.values()) or len(costs) < 2:
                continue
            second = min((name for name in costs if name != first), key=lambda name: loads[name] + costs[name])
            # moving a share x of the columns: loads[first] - x * costs[first] = loads[second] + x * costs[second]
            moved = (loads[first] - loads[second]) / (costs[first] + costs[second])
            steps = min(int(moved * SPLIT_STEPS), SPLIT_STEPS - 1)
            if steps <= 0:
                continue
            loads[first] -= costs[first] * steps / SPLIT_STEPS
            loads[second] += costs[second] * steps / SPLIT_STEPS
            splits[index] = (second, SPLIT_STEPS - steps)
        return splits

    def pick(self, operands, scope, stages: tuple[str, ...] = (), passes: int = 1, psum_dst: bool = False) -> str:
        """The engine argument text (empty for VectorE, the default) for an instruction over ``operands`` (Refs)
        in ``scope``; ``stages``: the nl operators of a tensor_scalar (ScalarE takes only some), or COPY;
        ``passes``: 2 for a tensor_tensor the engines stream at half rate; ``psum_dst``: it writes PSUM (which
        keeps it off GpSimd, and streams no faster than an SBUF destination)."""
        tiles = [ref for ref in operands if ref.tile is not None]
        on_psum = any(ref.tile in scope.allocator.psum_tiles for ref in tiles)
        full_tile = any(not ref.vector for ref in tiles)  # (P, 1) vector-only work stays on VectorE
        if not full_tile:  # one element per partition: no pass over the tile to weigh against the others
            return ENGINE_ARGUMENTS[self.choose({"vector": 0.0})]
        if on_psum:  # a PSUM operand streams beside the SBUF one: one pass (cost.py)
            passes = 1
        costs = {"vector": passes * (0.5 if tiles and all(ref.dtype == "bfloat16" for ref in tiles) else 1.0)}
        if not on_psum and not psum_dst and not any(ref.vector for ref in tiles):
            costs["gpsimd"] = passes * GPSIMD_COST
        if (stages in SCALAR_STAGES or stages == COPY) and all(
                ref.dtype in FLOAT_TILE_DTYPES for ref in tiles):
            costs["scalar"] = passes * SCALAR_COST
        return ENGINE_ARGUMENTS[self.choose(costs)]
