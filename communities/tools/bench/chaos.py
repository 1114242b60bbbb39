"""``communities bench chaos``: a soak under ULFM in which ranks are killed from outside, one every few seconds.

With ``--replicas R --processes P`` the job is a population (R replicas on P processes): each kill takes a
process and its block of R/P replicas, and the replicas the run reports lost must be exactly those blocks.

Why: a test that kills one chosen rank at one chosen point proves one path; users of elastic training trust
a job that keeps going while workers die at any moment, the writer included. So the launcher side here
starts a job with ``comm.fault_tolerance: shrink`` under Open MPI's ULFM, waits for its first signature
round, then every ``--every LO HI`` seconds (uniform) sends SIGKILL to a rank drawn at random among those
alive, rank 0 and the current writer included, until ``--keep`` ranks remain (one kill, drawn at random among
them, targets the writer itself unless ``--no-kill-writer``). The ranks' processes are found
as the launcher's descendants that carry an MPI rank in their environment (Open MPI's ``OMPI_COMM_WORLD_RANK``,
PMIx's ``PMIX_RANK``, MPICH's ``PMI_RANK``), so nothing in the job helps the killer.

The verdict on each run: the job's exit status; ``report.audit`` of its directory (complete, every product
and checkpoint matching its manifest, no temporaries, every unit of every rank in ``metrics.jsonl`` once);
``communities inspect`` reads it; the ranks the summary says were lost are the ranks killed; and its
consensus accuracy against the same job with no kill, run first.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from ..jobs import child_env, end, is_open_mpi, job_ranks, launcher_flags, require_mpiexec, start
from .common import fmt_table, machine_load, write_json

# per protocol: a checkpoint every 100 units under the virtual clock (kills land in them too); async checkpoints
# only at a stop and at the end
PROTOCOLS = {"sync": ["checkpoint.every=100"], "async": ["protocol=async", "comm.timeout=60"]}


def _summary(run: Path) -> Optional[dict]:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def launch(mpiexec: str, ranks: int, config: str, root: Path, name: str, *, sets: List[str]) -> subprocess.Popen:
    """The job under ULFM (Open MPI: ``--with-ft ulfm``), in a session of its own, its output to files."""
    cmd = [mpiexec, "-n", str(ranks), *launcher_flags(mpiexec)]
    if is_open_mpi(mpiexec):
        cmd += ["--with-ft", "ulfm"]
    cmd += [sys.executable, "-m", "communities", "run", config, f"output.root={root}", f"name={name}",
            "comm.fault_tolerance=shrink", "--no-progress", "--overwrite", *sets]
    out = open(root / f"{name}.out", "w")
    err = open(root / f"{name}.err", "w")
    return start(cmd, env=child_env(OMP_NUM_THREADS="1"), stdout=out, stderr=err)


def soak(proc: subprocess.Popen, run: Path, keep: int, every, rng: random.Random, *, timeout: float,
         writer_kill: Optional[int] = None) -> List[dict]:
    """Kill a random rank every U(every) seconds from the first round on, until ``keep`` remain; then wait.

    ``writer_kill``: the kill (0-based) that targets the writer, the lowest rank alive, rather than a random rank.
    """
    deadline = time.monotonic() + timeout
    kills: List[dict] = []
    while proc.poll() is None and not (run / "rounds" / "round_0000").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.time()
    while proc.poll() is None and time.monotonic() < deadline:
        ranks = job_ranks(proc.pid)
        alive = {r: p for r, p in ranks.items() if r not in {k["rank"] for k in kills}}
        if len(alive) <= keep:
            break
        time.sleep(rng.uniform(*every))
        if proc.poll() is not None or (run / "summary.json").exists():
            break  # the run ended (or is writing its end) before every kill landed
        alive = {r: p for r, p in job_ranks(proc.pid).items() if r not in {k["rank"] for k in kills}}
        if len(alive) <= keep:
            break
        rank = min(alive) if len(kills) == writer_kill else rng.choice(sorted(alive))
        try:
            os.kill(alive[rank], signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append({"rank": rank, "pid": alive[rank], "at_s": round(time.time() - start, 2)})
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        end(proc)
    return kills


def lost_replicas(kills: List[dict], processes: int, replicas: int) -> List[int]:
    """The replicas a run must report lost: every replica of each process killed (a population's block)."""
    per = replicas // processes
    return sorted(r for k in kills for r in range(k["rank"] * per, (k["rank"] + 1) * per))


def verdict(run: Path, kills: List[dict], returncode: int, processes: int, replicas: int) -> dict:
    """What the soak's run directory shows: the audit, inspect's exit, who was lost, who wrote."""
    from ...report.audit import audit

    problems = audit(run)
    res = subprocess.run([sys.executable, "-m", "communities", "inspect", str(run), "--out",
                          str(run.parent / f"{run.name}_report"), "--last"], capture_output=True, text=True)
    s = _summary(run) or {}
    membership = s.get("membership") or {}
    lost = sorted(e["rank"] for e in membership.get("lost", []))
    meta = json.loads((run / "meta.json").read_text()) if (run / "meta.json").exists() else {}
    recoveries = membership.get("recoveries", [])
    return {"exit": returncode, "problems": problems, "inspect_exit": res.returncode,
            "inspect_error": res.stderr.strip().splitlines()[-1:] if res.returncode else [],
            "killed": sorted(k["rank"] for k in kills), "lost": lost,
            "lost_as_killed": lost == lost_replicas(kills, processes, replicas),
            "writers": [w["rank"] for w in meta.get("writers", [])],
            "recoveries": len(recoveries), "survivors": len(membership.get("survivors", [])),
            "recover_s": [round(r["recovered_wall"] - r["detected_wall"], 3) for r in recoveries],
            "consensus_test_acc": s.get("consensus_test_acc"), "units": s.get("units")}


def bench_chaos(args) -> int:

    mpiexec = require_mpiexec(args.mpiexec, "communities bench chaos")
    root = Path(args.output_root or tempfile.mkdtemp(prefix="communities-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    processes = args.processes or args.ranks  # a population: --replicas on --processes (a kill takes a block)
    replicas = args.replicas or processes
    if replicas % processes:
        print(f"communities bench chaos: --replicas {replicas} is not a multiple of --processes {processes}")
        return 2
    what = f"{processes} ranks" if replicas == processes else f"{replicas} replicas on {processes} processes"
    print(f"communities bench chaos: {what}, a SIGKILL every {args.every[0]:g}-{args.every[1]:g} s "
          f"until {args.keep} processes remain; {machine_load()}; runs in {root}")
    rows, out = [], []
    ok = True
    for protocol in args.protocols:
        sets = [f"world_size={replicas}", *PROTOCOLS[protocol], *args.set]
        clean = launch(mpiexec, processes, args.config, root, f"{protocol}_clean", sets=sets)
        try:
            clean.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            end(clean)
        base = _summary(root / f"{protocol}_clean") or {}
        if clean.returncode != 0 or not base:
            tail = (root / f"{protocol}_clean.err").read_text()[-1500:]
            print(f"{protocol}: the run with no kill failed (exit {clean.returncode}):\n{tail}")
            ok = False
            continue
        t0 = time.monotonic()
        proc = launch(mpiexec, processes, args.config, root, f"{protocol}_chaos", sets=sets)
        rng = random.Random(args.seed)
        writer_kill = rng.randrange(processes - args.keep) if args.kill_writer else None
        kills = soak(proc, root / f"{protocol}_chaos", args.keep, args.every, rng, timeout=args.timeout,
                     writer_kill=writer_kill)
        wall = time.monotonic() - t0
        v = verdict(root / f"{protocol}_chaos", kills, proc.returncode, processes, replicas)
        v.update(protocol=protocol, kills=kills, wall_s=round(wall, 1), clean_wall_s=base.get("wall_time"),
                 clean_consensus_test_acc=base.get("consensus_test_acc"))
        acc, ref = v["consensus_test_acc"], v["clean_consensus_test_acc"]
        delta = None if acc is None or ref is None else 100 * (acc - ref)
        good = (v["exit"] == 0 and not v["problems"] and v["inspect_exit"] == 0 and v["lost_as_killed"]
                and len(kills) == processes - args.keep and delta is not None and delta >= -args.tolerance)
        ok &= good
        v["delta_points"], v["pass"] = delta, good
        out.append(v)
        writer_kills = sum(1 for k in kills if k["rank"] in v["writers"][:-1])
        rows.append([protocol, len(kills), writer_kills, "->".join(map(str, v["writers"])), v["exit"],
                     len(v["problems"]), v["inspect_exit"], "yes" if v["lost_as_killed"] else "NO",
                     f"{ref:.4f}" if ref is not None else None, f"{acc:.4f}" if acc is not None else None,
                     f"{delta:+.2f}" if delta is not None else None,
                     f"{max(v['recover_s']):.2f}" if v["recover_s"] else None, f"{wall:.0f}",
                     "pass" if good else "FAIL"])
        for p in v["problems"][:10]:
            print(f"  {protocol}: {p}")
        if v["exit"] != 0:
            print((root / f"{protocol}_chaos.err").read_text()[-2000:])
    print(fmt_table(["protocol", "kills", "of the writer", "writers", "exit", "damaged", "inspect", "lost = killed",
                      "no-kill acc", "chaos acc", "Δ points", "max shrink s", "wall s", "verdict"], rows))
    write_json(args.json, {"ranks": processes, "replicas": replicas, "keep": args.keep, "every": args.every,
                           "runs": out})
    if not args.output_root:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("chaos", help="a ULFM soak: SIGKILL a random rank (the writer included) every few seconds "
                                     "until N remain; check the run directory and the consensus")
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--keep", type=int, default=8, help="stop killing when this many ranks (processes) remain")
    p.add_argument("--processes", type=int, default=None, help="MPI processes (default: --ranks)")
    p.add_argument("--replicas", type=int, default=None,
                   help="a population: this many replicas on --processes processes (world_size); a kill takes a "
                        "process and its block of replicas, which must be exactly the replicas reported lost")
    p.add_argument("--every", type=float, nargs=2, default=[5.0, 10.0], metavar=("LO", "HI"),
                   help="seconds between kills, uniform in [LO, HI]")
    p.add_argument("--protocols", nargs="+", default=["sync", "async"], choices=sorted(PROTOCOLS))
    p.add_argument("--set", action="append", default=["consensus.stop=false", "train.budget=3000",
                                                      "comm.lost_shard=adopt"],
                   metavar="KEY=VALUE", help="a config override for both runs (repeatable; added to the defaults: "
                   "no consensus stop, 3000 units, adopted shards; sync also checkpoints every 100 units)")
    p.add_argument("--no-kill-writer", dest="kill_writer", action="store_false",
                   help="every kill at random (by default one of them, drawn at random, targets the writer: the "
                        "lowest rank alive)")
    p.add_argument("--tolerance", type=float, default=1.0, help="points of consensus accuracy the soak may lose")
    p.add_argument("--seed", type=int, default=0, help="seed of the killer's draws")
    p.add_argument("--mpiexec", default=None, help="an MPI launcher with ULFM (default: mpiexec next to python)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    p.add_argument("--output-root", default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_chaos)
