"""Golden runs: fixed configs whose consensus weights must not change by accident.

Each entry is a real ``mpiexec`` run of the engine through its command line. What is
recorded per run: the sha256 of ``consensus.pt``, the sha256 of the consensus weights
alone (the float bytes of every tensor, in state-dict order), and a few summary
figures. A change that moves any of them changes what the engine computes: either a
bug, or a deliberate change that re-records the table with ``--record``.

    python tests/helpers/golden_runs.py --record tests/helpers/golden.json    # all runs
    python tests/helpers/golden_runs.py --check tests/helpers/golden.json --only quickstart

The runs pin torch's kernels to AVX2 (``KERNEL_ENV``), so the hashes hold on any
x86-64 machine with AVX2 and the same torch and numpy builds; the table stores a
calibration of those kernels (``kernel_fingerprint``), and the test skips where the
calibration differs.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]  # the repository root
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script (make golden): tests.helpers must be importable
QUICK = "configs/quickstart.yaml"
SHORT = ["train.budget=30", "consensus.stop=false"]

# name -> (ranks, config, overrides)
RUNS = {
    "quickstart": (8, QUICK, []),
    "mnist1d": (8, "configs/mnist1d.yaml", ["seed=0"]),
    **{f"quickstart_{s}": (8, QUICK, [f"strategy={s}"])
       for s in ("gossip", "ring", "isolated", "local_sgd", "diloco", "allreduce")},
    # the engine's optional paths, on short runs
    "short_examples": (8, QUICK, SHORT + ["examples.track=true", "examples.retire=true", "examples.pass_hard=true",
                                          "examples.eval_every=3"]),
    "short_cka": (8, QUICK, SHORT + ["signature.kind=cka", "signature.dim=32", "signature.probe_size=64"]),
    "short_swap": (8, QUICK, SHORT + ["merge.rule=swap", "merge.partner_policy=least_recent"]),
    "short_overlap_hier": (8, QUICK, SHORT + ["signature.overlap=true", "partners.law=hierarchical",
                                              "clustering.cut=maxclust"]),
    "short_robust_hostile": (8, QUICK, SHORT + ["robust.enabled=true", "faults.hostile_rank=3", "faults.nan_rank=5",
                                                "faults.nan_at=7"]),
    "short_clock_outer": (8, QUICK, SHORT + ["merge.rule=clock", "merge.optimizer_state=average",
                                             "merge.outer.enabled=true"]),
    "short_ema_steps": (4, QUICK, SHORT + ["world_size=4", "data.groups=2", "merge.rule=ema", "train.unit=steps",
                                           "train.steps_per_unit=3", "merge.optimizer_state=reset"]),
}


# The golden runs pin torch's kernels to AVX2, the widest instruction set every x86-64 server CPU of the last
# decade has: ATen's dispatch, oneDNN and MKL otherwise pick AVX-512 paths where a CPU has them, and the float
# bits differ between an AVX2 and an AVX-512 machine although the engine computes the same thing. Pinned, a
# table recorded on one machine holds on the others (the table was recorded on an AVX2 machine; an AVX-512
# machine reproduces it bit for bit under these variables).
KERNEL_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

_CALIBRATION = """
import hashlib, torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
h = hashlib.sha256()
nets = [(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)), (32, 64)),
        (torch.nn.Sequential(torch.nn.Conv1d(1, 25, 5, stride=2), torch.nn.ReLU(), torch.nn.Flatten(),
                             torch.nn.Linear(25 * 18, 10)), (64, 1, 40))]
for net, shape in nets:
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(5):
        x, y = torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
print(h.hexdigest()[:16])
"""


@functools.lru_cache(maxsize=None)
def kernel_fingerprint() -> str:
    """A hash of the float bits a few seeded training steps give here under ``KERNEL_ENV``: the kernels' own
    fingerprint (the engine's layer kinds, at the quickstart's and MNIST-1D's widths, on one thread).

    A table is checked only where this matches the calibration recorded with it: a machine that cannot run
    the pinned kernels (no AVX2, another architecture) or another torch build computes other bits.
    """
    env = dict(os.environ, **KERNEL_ENV)
    return subprocess.run([sys.executable, "-c", _CALIBRATION], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def fingerprint() -> str:
    """What the table was recorded with, for people: CPU, machine, torch and numpy versions."""
    import numpy
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|{platform.machine()}|torch {torch.__version__}|numpy {numpy.__version__}"


def weights_sha(path: Path) -> str:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    h = hashlib.sha256()
    for key, value in state.items():
        h.update(key.encode())
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# The table's runs keep the clustering they were recorded with: average linkage, no Lloyd refinement and the
# best-silhouette cut above a floor of 0.25 (the defaults before the community test). The community test's own
# bits are pinned by tests/unit/test_significance.py; what the table guards is the rest of the engine.
RECORDED_CLUSTERING = ["clustering.linkage=average", "clustering.refine=false", "clustering.alpha=null",
                       "clustering.min_silhouette=0.25"]


def job_overrides(name: str) -> List[str]:
    """The overrides of golden entry ``name``, with its run directory's name."""
    return [f"name={name}", *RECORDED_CLUSTERING, *RUNS[name][2]]


def record_of(run_dir: Path) -> dict:
    """What the table records of one finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "consensus_pt_sha256": hashlib.sha256((run_dir / "consensus.pt").read_bytes()).hexdigest(),
        "weights_sha256": weights_sha(run_dir / "consensus.pt"),
        "consensus_test_acc": summary["consensus_test_acc"],
        "units": summary["units"],
        "merges": summary["merges"],
        "bytes_sent_mean": summary["bytes_sent_mean"],
        "final_dispersion": summary["final_dispersion"],
        "communities_per_round": summary["communities_per_round"],
    }


def run_one(name: str, root: Path, timeout: float = 900, processes: int = 0) -> dict:
    """Run golden entry ``name`` under ``root`` as its own mpiexec job, on the pinned kernels; returns its record.

    ``processes`` (0: one per replica) places the entry's replicas on that many MPI processes (a population):
    placement must not change any recorded figure."""
    from tests.helpers.mpi import mpi_command, run_command

    n, config, _ = RUNS[name]
    args = ["-m", "communities", "run", ROOT / config, f"output.root={root}", "--no-progress", "--overwrite",
            *job_overrides(name), *([f"world_size={n}"] if processes else [])]
    run_command(mpi_command(processes or n, args), timeout, f"golden run {name}", env=KERNEL_ENV)
    return record_of(root / name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="JSON")
    mode.add_argument("--check", metavar="JSON")
    p.add_argument("--only", nargs="*", default=None, help="run these entries only")
    p.add_argument("--processes", type=int, default=0,
                   help="run each entry's replicas on this many MPI processes (default: one per replica)")
    args = p.parse_args(argv)
    names = args.only or list(RUNS)
    path = Path(args.record or args.check)
    table = json.loads(path.read_text()) if args.check or path.exists() else {}
    failures = []
    if args.check and table.get("kernels") != kernel_fingerprint():
        print(f"cannot check here: this machine's pinned kernels compute other bits (calibration "
              f"{kernel_fingerprint()}, the table's {table.get('kernels')}, recorded on {table.get('fingerprint')})")
        return 0
    with tempfile.TemporaryDirectory(prefix="golden_") as tmp:
        for name in names:
            got = run_one(name, Path(tmp), processes=args.processes)
            if args.record:
                table.setdefault("runs", {})[name] = got
                print(f"{name}: {got['consensus_pt_sha256']} acc {got['consensus_test_acc']}", flush=True)
            else:
                want = table["runs"][name]
                ok = got == want
                print(f"{name}: {'same' if ok else 'DIFFERENT'} {got['consensus_pt_sha256']}", flush=True)
                if not ok:
                    failures.append(name)
                    for key in want:
                        if want[key] != got.get(key):
                            print(f"  {key}: recorded {want[key]!r}, now {got.get(key)!r}")
    if args.record:
        table["fingerprint"] = fingerprint()
        table["kernels"] = kernel_fingerprint()
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
