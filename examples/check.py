"""The verdict of the examples' ``--check``: distances to a one-process run of the
unsharded model on the global batch, each against a stated tolerance.

[Note: --check tolerances]
The step-0 loss compares forwards of identical weights: only the order of
float32 sums differs, so it must agree to 1e-5. Later steps depend on AdamW's
updates, ``lr * m / (sqrt(v) + eps)``, which normalise each gradient element by
its own magnitude: an element whose gradient is near zero (where rounding noise is
as large as the value) moves by up to ``lr`` in a direction rounding decides.
These few elements grow the differences over the steps; at the examples'
defaults (10 steps, lr 3e-3) the loss differs by up to a few 1e-5 and parameters
by about 1e-4 *between two one-process runs* that only split the batch into
microbatches differently. So the later steps are held to 2e-4 (loss) and 1e-3
(parameters): ten times that noise, and still ten times below what a missing or
doubled reduction causes within a few steps. With bf16 compute the distance to
the float32 reference is bf16 rounding (about 3 significant digits).
"""

from __future__ import annotations

from collections.abc import Sequence

# (what, tolerance) per compute dtype, in the order the rows are reported.
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {
        "loss at step 0": 1e-5,
        "max loss diff over all steps": 2e-4,
        "max parameter diff": 1e-3,
    },
    # bf16 vs the float32 reference (train_tp.py --mp bf16, 10 steps: 7.3e-5, 1.0e-2,
    # 1.9e-2 measured)
    "bf16": {
        "loss at step 0": 1e-3,
        "max loss diff over all steps": 5e-2,
        "max parameter diff": 5e-2,
    },
}


def report(measured: dict[str, float], *, dtype: str = "fp32", show: bool = True) -> int:
    """Prints each distance with its tolerance and PASS/FAIL, then the verdict.

    Args:
        measured: distance per row name of ``TOLERANCES[dtype]`` (the same value on
            every rank, so every rank returns the same status).
        dtype: the compute dtype of the run (``"fp32"`` or ``"bf16"``).
        show: print (rank 0 only).

    Returns:
        The process exit status: 0 if every distance is within its tolerance, else 1.
    """
    tolerances = TOLERANCES[dtype]
    missing = set(tolerances) - set(measured)
    if missing:
        raise ValueError(f"no measurement for {sorted(missing)}")
    rows: Sequence[tuple[str, float, float]] = [(k, measured[k], t) for k, t in tolerances.items()]
    # NaN fails: it is not <= anything.
    failed = [name for name, value, tol in rows if not value <= tol]
    if show:
        print(
            f"check vs one process on the global batch ({dtype}; tolerances: see examples/check.py):"
        )
        for name, value, tol in rows:
            verdict = "PASS" if name not in failed else "FAIL"
            print(f"  {name:<30} {value:9.2e}  (tolerance {tol:.0e})  {verdict}")
        print("FAIL" if failed else "PASS")
    return 1 if failed else 0
