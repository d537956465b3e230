"""Simulator stage: the communication cost model — a time for each collective a kernel ran (``nki.collectives``).

Input: a collective's name, its ranks and the bytes of one rank's input and output (the attributes of a
``collective_*`` trace instruction, simulator/collectives.py). Output: its estimated seconds on trn2 links. The
cost model (cost.py) gives each collective instruction this duration on the ``collective`` queue, so the schedule
shows how much communication compute hides (``CostReport.comm_overlap_s``) and the launch's time includes the rest.

The model is the bandwidth-optimal ring (as NCCL and the Neuron collectives run large messages): n ranks, n - 1
steps per phase, each rank sending 1/n of the buffer per step over one link.

* all_reduce (reduce-scatter then all-gather): 2 (n - 1) / n x bytes / link bandwidth + 2 (n - 1) x step latency
* all_gather: (n - 1) / n x output bytes / bandwidth + (n - 1) x step latency
* reduce_scatter: (n - 1) / n x input bytes / bandwidth + (n - 1) x step latency
* all_to_all (pairwise exchange): (n - 1) / n x input bytes / bandwidth + (n - 1) x step latency

Numbers, marked [A] where they are assumptions rather than published figures:
* [P] NeuronLink-v3: 1.28 TB/s of chip-to-chip bandwidth per Trainium2 chip, over 4 links (the Trainium2
  architecture pages of the AWS Neuron documentation; shared/docs/nki-spec.md, the hardware table).
* [A] one ring direction uses one link: LINK_BYTES_PER_S = 1.28 TB/s / 4 = 320 GB/s.
* [A] STEP_LATENCY_S = 5 us per ring step (synchronisation and DMA descriptor setup between neighbours); no
  published per-hop figure was found.
"""

from __future__ import annotations

CHIP_LINK_BYTES_PER_S = 1.28e12  # [P] NeuronLink-v3, per Trainium2 chip
LINKS_PER_CHIP = 4  # [P]
LINK_BYTES_PER_S = CHIP_LINK_BYTES_PER_S / LINKS_PER_CHIP  # [A] a ring direction runs on one link
STEP_LATENCY_S = 5e-6  # [A] per ring step

# (phases of n - 1 steps, whether the moved volume is the output's size rather than the input's)
RING_PHASES = {"all_reduce": (2, False), "all_gather": (1, True), "reduce_scatter": (1, False),
               "all_to_all": (1, False)}


def collective_time_s(name: str, ranks: int, input_bytes: int, output_bytes: int) -> float:
    """Estimated seconds of one ring collective (see the module docstring); 0 on one rank."""
    if ranks <= 1:
        return 0.0
    if name not in RING_PHASES:
        raise ValueError(f"[comm_unknown_collective] no cost formula for {name!r} (known: {sorted(RING_PHASES)})")
    phases, by_output = RING_PHASES[name]
    volume = output_bytes if by_output else input_bytes
    steps = phases * (ranks - 1)
    return phases * (ranks - 1) / ranks * volume / LINK_BYTES_PER_S + steps * STEP_LATENCY_S
